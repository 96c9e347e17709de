"""The ``cacheon`` command: inspect plugins and slots, verify variants, read receipts."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._plugins import Discovery, discover
from ._receipts import ReceiptFormatError, coverage_report, read_receipts
from ._verify import VerifyResult, verify_variant
from ._wire import converter

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNSUPPORTED = 3


def _emit_json(value: Any) -> None:
    print(json.dumps(converter.unstructure(value), indent=2, sort_keys=True))


def cmd_plugins(args: argparse.Namespace) -> int:
    found = discover(load_variants=True)
    if args.json:
        _emit_json(list(found.plugins))
    else:
        for p in found.plugins:
            print(f"{p.distribution} {p.version} [{p.name} = {p.value}]: {p.status}")
            if p.reason:
                print(f"    reason: {p.reason}")
            for slot in p.slots:
                print(f"    slot    {slot}")
            for v in p.variants:
                flags = " graph_safe" if v.graph_safe else ""
                print(f"    variant {v.slot} {v.name} (priority {v.priority}{flags})")
            for a in p.adapters:
                print(f"    seam    {a.engine}: {a.slot} at {a.module}.{a.target} (binding {a.binding})")
    return EXIT_FAILED if found.failures else EXIT_OK


def _slot_rows(found: Discovery) -> list[dict[str, Any]]:
    rows = []
    for slot_id, spec in sorted(found.slots.items()):
        chokepoints = [f"{a.engine}: {a.module}.{a.target}" for a in found.adapters if a.slot == slot_id]
        rows.append(
            {
                "id": slot_id,
                "version": spec.version,
                "summary": spec.summary,
                "defined_by": found.slot_owner[slot_id],
                "inputs": [converter.unstructure(t) for t in spec.inputs],
                "outputs": [converter.unstructure(t) for t in spec.outputs],
                "scalars": [converter.unstructure(s) for s in spec.scalars],
                "reference": converter.unstructure(spec.reference, Any),
                "variants": [v.name for v in found.variants if v.slot == slot_id],
                "chokepoints": chokepoints,
                "live": bool(chokepoints),
                "collective": spec.collective,
            }
        )
    return rows


def cmd_slots(args: argparse.Namespace) -> int:
    found = discover(load_variants=True)
    rows = _slot_rows(found)
    if args.json:
        _emit_json(rows)
        return EXIT_OK
    for row in rows:
        print(f"{row['id']} v{row['version']}: {row['summary']}")
        sig = (
            ", ".join(f"{t['name']}{list(t['shape'])}" for t in row["inputs"])
            + (", " if row["scalars"] else "")
            + ", ".join(s["name"] for s in row["scalars"])
            + (", group" if row["collective"] else "")
        )
        outs = ", ".join(f"{t['name']}{list(t['shape'])}" for t in row["outputs"])
        print(f"    contract: ({sig}) -> {outs}; defined by {row['defined_by']}")
        if row["collective"]:
            print("    collective: spans the ranks of group; the ranks agree on the route before a candidate serves it")
        print(f"    variants: {', '.join(row['variants']) or 'none installed'}")
        if row["live"]:
            for c in row["chokepoints"]:
                print(f"    chokepoint: {c}")
        else:
            print("    no live adapter: no installed engine package exposes a chokepoint for this slot")
    return EXIT_OK


def _print_verify(result: VerifyResult) -> None:
    print(f"{result.slot} {result.variant} on {result.device}: {result.status.upper()}")
    if result.reason:
        print(f"    reason: {result.reason}")
    if result.graph is not None:
        print(f"    cuda graph: {result.graph if result.graph == 'qualified' else 'eager only: ' + result.graph}")
    for case in result.cases:
        dims = ",".join(f"{k}={v}" for k, v in case.dims.items())
        line = f"    {case.status:<11} {case.dtype:<9} {case.layout:<10} {dims}"
        if case.reason and case.status != "passed":
            line += f": {case.reason}"
        print(line)


def cmd_verify(args: argparse.Namespace) -> int:
    found = discover(load_variants=True)
    for p in found.failures:
        print(f"warning: plugin {p.distribution} failed to load: {p.reason}", file=sys.stderr)
    spec = found.slots.get(args.slot)
    if spec is None:
        print(f"error: unknown slot {args.slot!r}; known slots: {sorted(found.slots)}", file=sys.stderr)
        return EXIT_USAGE
    variants = [v for v in found.variants if v.slot == args.slot]
    if args.variant is not None:
        variants = [v for v in variants if v.name == args.variant]
        if not variants:
            names = sorted(v.name for v in found.variants if v.slot == args.slot)
            print(f"error: slot {args.slot} has no variant {args.variant!r}; installed: {names}", file=sys.stderr)
            return EXIT_USAGE
    if not variants:
        print(f"error: no variant of {args.slot} is installed", file=sys.stderr)
        return EXIT_USAGE
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
            return EXIT_USAGE
    results = [verify_variant(spec, v, args.device, seed=args.seed) for v in variants]
    if args.json:
        _emit_json(results)
    else:
        for r in results:
            _print_verify(r)
    if any(r.status == "rejected" for r in results):
        return EXIT_FAILED
    if any(r.status == "unsupported" for r in results):
        return EXIT_UNSUPPORTED
    return EXIT_OK


def cmd_receipts(args: argparse.Namespace) -> int:
    try:
        receipts = read_receipts(args.directory)
    except (FileNotFoundError, ReceiptFormatError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    report = coverage_report(receipts, args.expect_ranks)
    if args.json:
        _emit_json(
            {
                "ok": report.ok,
                "members": report.members,
                "problems": report.problems,
                "coverage": {s: {str(r): c for r, c in by.items()} for s, by in report.coverage.items()},
                "routes": {s: {str(r): list(v) for r, v in by.items()} for s, by in report.routes.items()},
                "receipts": receipts,
            }
        )
    else:
        print(f"{len(receipts)} receipts, {len(report.members)} active members")
        for m in report.members:
            print(f"    active: rank {m.rank} {m.role} pid {m.pid} on {m.host}: {', '.join(m.slots)}")
        for slot, by_rank in report.coverage.items():
            for rank, c in by_rank.items():
                print(
                    f"    {slot} rank {rank}: fired {c.fired}, completed {c.completed}, "
                    f"fallback {c.fallback}, failed {c.failed}, captured {c.captured}, replayed {c.replayed}; "
                    f"ran {c.ran}"
                )
        for slot, routes in report.routes.items():
            for rank, chosen in routes.items():
                tally = ", ".join(f"{name} {chosen.count(name)}" for name in dict.fromkeys(chosen))
                print(f"    {slot} rank {rank}: routes agreed for {len(chosen)} call shapes: {tally}")
        for problem in report.problems:
            print(f"PROBLEM: {problem}")
        print("OK" if report.ok else "NOT OK")
    return EXIT_OK if report.ok else EXIT_FAILED


def _engine(name: str) -> Any:
    """The ``cacheon.engines`` entry point of an installed engine package (cacheon-sglang: ``sglang``)."""
    from importlib import metadata

    found = [ep for ep in metadata.entry_points(group="cacheon.engines") if ep.name == name]
    if not found:
        known = sorted(ep.name for ep in metadata.entry_points(group="cacheon.engines"))
        raise LookupError(f"no engine package for {name!r} is installed (installed: {known or 'none'})")
    return found[0].load()


def cmd_canary(args: argparse.Namespace) -> int:
    try:
        engine = _engine(args.engine)
        rows = engine.run_canary(args.source)
    except (LookupError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    broken = [r for r in rows if r.status == "break"]
    if args.json:
        _emit_json(
            {
                "engine": engine.ENGINE,
                "pin": engine.PIN,
                "installed": engine.installed_version(),
                "rows": rows,
                "ok": not broken,
            }
        )
    else:
        where = args.source or f"installed {engine.ENGINE} {engine.installed_version()}"
        print(f"{engine.ENGINE} canary (pin {engine.PIN}) against {where}")
        for r in rows:
            line = f"    {r.status:<12} {r.row:<18} {r.module}.{r.target}"
            if r.reason:
                line += f": {r.reason}"
            print(line)
        print("OK" if not broken else f"BROKEN: {len(broken)} row(s)")
    return EXIT_FAILED if broken else EXIT_OK


def cmd_env(args: argparse.Namespace) -> int:
    try:
        engine = _engine(args.engine)
        env = engine.launch_environment(sorted(set(args.bind)) if args.bind else list(engine.DEFAULT_BINDINGS))
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:  # BindingError: unknown, duplicated or non-canonical binding
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(env, indent=2, sort_keys=True))
    else:
        for key, value in sorted(env.items()):
            print(f"{key}={value}")
    return EXIT_OK


def cmd_bundle_build(args: argparse.Namespace) -> int:
    from ._bundle import BundleError, build_bundle, sign_bundle

    try:
        manifest = build_bundle(args.sources, args.out)
        release = sign_bundle(args.out, Path(args.sign_key).read_bytes()) if args.sign_key else None
    except BundleError as exc:
        print(f"cacheon bundle build: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps({"manifest": manifest, "release": release}, indent=2, sort_keys=True))
        return EXIT_OK
    for c in manifest["contributions"]:
        print(f"{c['name']}: {c['namespace']} ({len(c['files'])} files; requires {', '.join(c['requires']) or '-'})")
    print(f"tree digest  {manifest['tree_digest']}")
    print(f"stack digest {manifest['stack_digest']}")
    if release:
        print(f"signed: release.json manifest digest {release['manifest_digest']}")
    return EXIT_OK


def cmd_bundle_inspect(args: argparse.Namespace) -> int:
    from ._bundle import MANIFEST, BundleError, verify_bundle

    key = Path(args.public_key).read_bytes() if args.public_key else None
    try:
        verified = verify_bundle(args.tree, mount=args.mount, public_key_pem=key)
        manifest, verdict, reason = verified.manifest, "verified" + (" and signed" if key else ""), None
    except BundleError as exc:
        verdict, reason = "REFUSED", str(exc)
        try:
            manifest = json.loads((Path(args.tree) / MANIFEST).read_text())
        except (OSError, ValueError):
            manifest = None
    if args.json:
        print(json.dumps({"verdict": verdict, "reason": reason, "manifest": manifest}, indent=2, sort_keys=True))
    else:
        if isinstance(manifest, dict):
            for c in manifest.get("contributions") or []:
                print(f"{c.get('name')}: {c.get('namespace')} ({len(c.get('files') or {})} files)")
            for served in (manifest.get("stack") or {}).get("contributions", []):
                for slot, name, version, priority, graph_safe in served["variants"]:
                    flags = " graph_safe" if graph_safe else ""
                    print(f"    variant {slot} v{version} {name} (priority {priority}{flags})")
                for binding in served["bindings"]:
                    print(f"    binding {binding}")
            print(f"tree digest  {manifest.get('tree_digest')}")
            print(f"stack digest {manifest.get('stack_digest')}")
        print(f"{verdict}{': ' + reason if reason else ''}")
    return EXIT_OK if reason is None else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list discovered plugins, their slots and variants (exit 1 if any failed)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("slots", help="list slot contracts, their variants and live chokepoints")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_slots)

    p = sub.add_parser(
        "verify",
        help="check variants against the slot reference on random inputs",
        description="Each variant runs at the slot's sizes, then at those it declares (verify_dims). "
        "Exit 0 when every selected variant passes, 1 when one is rejected (the reason is "
        "printed), 3 when a variant supports no verification case on the device. A collective slot's "
        "variants run on two ranks of their own joined over gloo.",
    )
    p.add_argument("slot", help="slot id, e.g. norm.rmsnorm")
    p.add_argument("--variant", help="verify only this variant (default: every installed variant)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the inputs (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "receipts",
        help="report slot x rank coverage from a receipt directory",
        description="Exit 1 on missing or extra active members, any load_failed or failed receipt, "
        "any fallback under the strict policy, or (with --expect-ranks) a rank missing from a collective "
        "slot's agreed routes or ranks that report different routes.",
    )
    p.add_argument("directory", help="the CACHEON_RECEIPT_DIR the processes wrote to")
    p.add_argument(
        "--expect-ranks",
        type=int,
        default=None,
        metavar="N",
        help="exactly one active scheduler per rank 0..N-1, and every rank in each collective slot's routes",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_receipts)

    p = sub.add_parser(
        "canary",
        help="check an engine package's adapter table and the engine interfaces it implements (the vLLM "
        "connector, the SGLang cache linker) against the installed engine (or a source tree or wheel)",
        description="Exit 0 when no row breaks (unassessable rows are listed, never counted as passing), "
        "1 on any break, 2 when the engine package is not installed.",
    )
    p.add_argument("engine", help="engine name, e.g. sglang")
    p.add_argument(
        "--source",
        help="check this source tree (sglang, vllm) or wheel (vllm) statically instead of the installed package",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_canary)

    p = sub.add_parser(
        "env",
        help="print the complete seam environment for a launch: every binding gate set to 0 or 1",
        description="Without --bind, the engine's default bindings are armed and every other gate is 0.",
    )
    p.add_argument("engine", help="engine name, e.g. sglang")
    p.add_argument(
        "--bind",
        action="append",
        default=[],
        metavar="BINDING",
        help="arm this binding (repeatable); the full set replaces the defaults",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("bundle", help="build or inspect a sealed engine tree of contributions")
    bundle = p.add_subparsers(dest="bundle_command", required=True)
    b = bundle.add_parser(
        "build",
        help="seal contributions into a new engine tree",
        description="Each SRC is PACKAGE_DIR[:PLUGIN_MODULE]; its import closure is copied under "
        "cacheon_c_<sha256 of its content> and manifest.json records every digest. Exit 1 when a "
        "contribution cannot be sealed (the reason is printed).",
    )
    b.add_argument("sources", nargs="+", metavar="SRC", help="PACKAGE_DIR[:PLUGIN_MODULE]")
    b.add_argument("--out", required=True, help="the tree to create (must not exist)")
    b.add_argument("--sign-key", metavar="PEM", help="Ed25519 private key: also write release.json and release.sig")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=cmd_bundle_build)
    b = bundle.add_parser(
        "inspect",
        help="print what a tree contains and whether it verifies",
        description="Makes every check loading would make, without importing anything. Exit 0 when it "
        "verifies, 1 with the reason when it does not.",
    )
    b.add_argument("tree", help="the engine tree")
    b.add_argument("--mount", help="also require the tree to be at this path (loading requires the configured mount)")
    b.add_argument("--public-key", metavar="PEM", help="require release.sig to verify against this Ed25519 public key")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=cmd_bundle_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
