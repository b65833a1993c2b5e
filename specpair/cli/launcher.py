"""`specpair up`: the three services on this machine, as one ServiceGroup."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from specpair.cli.group import Service, ServiceGroup
from specpair.cli.options import TOKEN_ENV
from specpair.config import (
    MAX_HANDOFF_ROWS,
    MODELS_DIR,
    FeatureDType,
    describe_ranks,
    env_address,
    env_http_address,
    rank_devices,
)

READY = "specpair up: all services up"  # the line a script may wait for (bench/up_client.py)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specpair"


# Where flashinfer and Triton keep the kernels they compile on first use (the services' warm-up,
# on a GPU). Their own defaults (~/.cache/flashinfer, ~/.triton/cache) outlive a process too;
# `up` keeps both with its own, so `rm -r ~/.cache/specpair` is a clean start. A value the
# environment already sets (the image's, an operator's) wins.
KERNEL_CACHES = {"FLASHINFER_WORKSPACE_BASE": "flashinfer", "TRITON_CACHE_DIR": "triton"}


def kernel_cache_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with each kernel cache it does not set under cache_dir()."""
    return {name: str(cache_dir() / sub) for name, sub in KERNEL_CACHES.items()} | dict(environ)


def default_models(draft_kind: str) -> tuple[Path, Path, bool]:
    """(target, draft, bundled): the bundled pair under models/, else a generated tiny pair."""
    target = MODELS_DIR / "target"
    draft = MODELS_DIR / ("eagle" if draft_kind == "eagle" else "draft")
    if (target / "config.json").is_file() and (draft / "config.json").is_file():
        return target, draft, True
    from specpair.models.tiny import make_tiny_eagle, make_tiny_llama

    root = cache_dir() / "tiny-pair"
    tiny_target = root / "target"
    if not (tiny_target / "config.json").is_file():
        make_tiny_llama(tiny_target, seed=1, hidden_size=128, num_layers=4)
    if draft_kind == "eagle":
        tiny_draft = make_tiny_eagle(root / "eagle", tiny_target, seed=3)
    else:
        tiny_draft = root / "draft"
        if not (tiny_draft / "config.json").is_file():
            make_tiny_llama(tiny_draft, seed=2, hidden_size=64, num_layers=1)
    return tiny_target, tiny_draft, False


def served_models(args: argparse.Namespace) -> tuple[Path, Path, str]:
    """(target, draft, a note naming them): the models given, the rest by default. A pair given
    whole never generates the tiny one."""
    if args.target_model and args.draft_model:
        target, draft = args.target_model, args.draft_model
        return target, draft, f"model pair (target {target}, draft {draft})"
    default_target, default_draft, bundled = default_models(args.draft_kind)
    target = args.target_model or default_target
    draft = args.draft_model or default_draft
    pair = f"(target {target}, draft {draft})"
    if bundled:
        given = args.target_model or args.draft_model
        return target, draft, f"{'model pair' if given else 'bundled model pair'} {pair}"
    return (
        target,
        draft,
        (
            f"NOTE: no bundled models under {MODELS_DIR}; serving a generated tiny RANDOM model "
            f"where none was given {pair} — output is gibberish, acceptance is not meaningful"
        ),
    )


def draft_device(args: argparse.Namespace) -> str:
    """--draft-device, else the target's rank 0 device: `--device cuda --tensor-parallel 4`
    puts the draft on cuda:0, beside rank 0 (which serves and waits on the draft's messages)."""
    return str(args.draft_device or rank_devices(args.device, args.tensor_parallel)[0])


def placement(args: argparse.Namespace) -> str:
    """Where `up` puts the models: `draft on cuda:0, target on cuda:0-3 (tensor-parallel 4)`;
    a draft on a GPU of a follower rank says so (it shares that GPU with the rank's shard)."""
    draft = draft_device(args)
    line = f"draft on {draft}, target on {describe_ranks(args.device, args.tensor_parallel)}"
    ranks = rank_devices(args.device, args.tensor_parallel)
    if draft.startswith("cuda") and draft in ranks[1:]:
        line += f"; the draft shares {draft} with target rank {ranks.index(draft)}"
    return line


# `up`'s max batch on a GPU (the target's own default, 16, elsewhere): 64 concurrent requests
# decode together, the graph buckets 1 … 64 built at start-up. On an H200 the grown 8B target
# alone gives 4272 tok/s at 64 clients against 3227 at 32 (bench/RESULTS.md, "up_client").
UP_GPU_MAX_BATCH = 64
# `up`'s draft window with an EAGLE head on a GPU (the target's own default, 0: the whole
# history, elsewhere): a joiner's hand-off carries 32 tokens' feature rows, not the prompt's.
# On an H200 (grown 8B + EAGLE-3, SGLang's rule) it beat the whole history in every cell
# measured: 96-128-token prompts 1.33x against 0.90x the target alone at 64 clients, 512-token
# prompts 0.91x against 0.23x, batch 1 level, though acceptance fell on the longer prompts
# (bench/RESULTS.md, "Draft window").
UP_GPU_EAGLE_DRAFT_WINDOW = 32


def up_services(args: argparse.Namespace, token: str | None = None) -> tuple[list[Service], str]:
    """(draft, target, controller on their SPECPAIR_*_ADDRESS, a note on the models); `token`:
    the ops token all three are given."""
    target, draft, note = served_models(args)
    device = ("--device", args.device)
    draft_args: tuple[str, ...] = (
        "draft",
        "--model",
        str(draft),
        "--draft-kind",
        str(args.draft_kind),
        "--device",
        draft_device(args),
    )
    shapes = tuple(arg for shape in args.tree_shapes for arg in ("--tree-shapes", shape))
    draft_args += shapes
    if args.draft_kind == "eagle":
        draft_args += ("--target-model", str(target))
    if args.draft_token_map:
        draft_args += ("--token-map", str(args.draft_token_map))
    controller_args: tuple[str, ...] = ("controller", "--target", env_address("target"))
    if args.policy:
        controller_args += ("--policy", str(args.policy))
    from specpair.runtime.build import feature_layers  # torch: only when starting services

    # Tier 0 (the target alone) is built too: the demo measures tokens/s against it.
    target_args: tuple[str, ...] = ("target", "--model", str(target), *device)
    target_args += ("--candidate-steps", "0,1,3,7")
    target_args += shapes
    if args.tensor_parallel > 1:
        target_args += ("--tensor-parallel", str(args.tensor_parallel))
    max_batch = args.max_batch or (UP_GPU_MAX_BATCH if args.device.startswith("cuda") else None)
    if max_batch:
        target_args += ("--max-batch", str(max_batch))
    if args.deterministic:
        target_args += ("--deterministic",)
    if args.feature_dtype != FeatureDType.AUTO:
        target_args += ("--feature-dtype", args.feature_dtype)
    if args.feature_ring_mib is not None:
        target_args += ("--feature-ring-mib", str(args.feature_ring_mib))
    window = args.draft_window
    if window is None and args.draft_kind == "eagle" and args.device.startswith("cuda"):
        window = UP_GPU_EAGLE_DRAFT_WINDOW
    if window is not None:
        target_args += ("--draft-window", str(window))
        if 0 < window <= MAX_HANDOFF_ROWS:  # the draft extends the window's hand-offs in graphs
            draft_args += ("--handoff-rows", str(window))
    if args.draft_kind == "eagle" and (layers := feature_layers(draft, target)):
        target_args += ("--feature-layers", ",".join(map(str, layers)))  # an EAGLE-3 head's
    env = kernel_cache_env(os.environ) | ({TOKEN_ENV: token} if token else {})
    services = [
        Service("draft", env_address("draft"), draft_args, env),
        Service("target", env_address("target"), target_args, env),
        Service("controller", env_address("controller"), controller_args, env),
    ]
    return services, note


def ops_token_file() -> Path:
    """Where `up` keeps the ops token it made for its group, and where `ctl` looks for one."""
    return cache_dir() / "ops-token"


def keep_ops_token(token: str) -> None:
    """Writes `token` to `ops_token_file()`, readable by this user alone."""
    path = ops_token_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


def stored_ops_token() -> str | None:
    """The token `up` made for its group, when it made one."""
    try:
        return ops_token_file().read_text().strip() or None
    except OSError:
        return None


def group_token() -> str:
    """A token for a group started with none set. Without one, the draft's Round stream, the
    target's ApplyTier and WatchRounds and the controller's ops API answer anyone who reaches
    them: one local process could hold the draft's slots or the watcher places."""
    token = secrets.token_urlsafe(32)
    try:
        keep_ops_token(token)
        where = f"in {ops_token_file()}, where specpair ctl finds it"
    except OSError as exc:  # still the group's token: `ctl` then needs it given
        where = f"but could not keep it ({exc}): set {TOKEN_ENV} to use specpair ctl"
    print(f"specpair up: no {TOKEN_ENV} set: made one for this group, {where}", flush=True)
    return token


def run_up(args: argparse.Namespace, check: Callable[[Sequence[str]], object]) -> int:
    """`check`: a service's `serve` arguments, validated as `serve` validates them (ValueError
    naming the fault): every service is checked before the first starts, so a bad policy file
    fails in a second, not after both models have loaded."""
    token = os.environ.get(TOKEN_ENV) or group_token()
    services, note = up_services(args, token)
    print(f"specpair up: {note}", flush=True)
    print(f"specpair up: {placement(args)}", flush=True)
    for service in services:
        try:
            check(service.args)
        except ValueError as exc:
            print(f"specpair up: error: {service.name}: {exc}", file=sys.stderr)
            return 2
    group = ServiceGroup()
    # SIGTERM (kill, docker, systemd) stops the group as Ctrl-C does, children included.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for service in services:
            print(f"specpair up: starting {service.name} on {service.address} …", flush=True)
            group.start(service)
            print(f"specpair up: {service.name} is serving", flush=True)
        http = env_http_address()  # the target's default, as it read it
        api = f", the OpenAI-compatible API at http://{http}/v1" if http else ""
        print(f"{READY}{api} (Ctrl-C stops them)", flush=True)
        if args.demo:
            from specpair.cli.demo import run_demo

            key = os.environ.get("SPECPAIR_API_KEY")
            run_demo(
                env_address("target"), env_address("controller"), http, token=token, api_key=key
            )
        while (name := group.exited()) is None:
            time.sleep(0.5)
        code = group.procs[name].returncode
        print(f"specpair up: {name} exited with code {code}; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nspecpair up: stopping …", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"specpair up: {exc}; stopping the others", file=sys.stderr)
        return 1
    finally:
        group.stop()
