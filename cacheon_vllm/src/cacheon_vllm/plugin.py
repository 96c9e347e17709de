"""The ``vllm.general_plugins`` entry point: registers OrbitKVConnector with vLLM's connector factory."""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "OrbitKVConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("OrbitKVConnector", "cacheon_vllm.connector", "OrbitKVConnector")
