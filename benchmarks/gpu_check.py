"""GPU check of the training path a GPU user runs: the FSDP2 `Learner`, DPPO steps, the
weight sync into a real `VLLMEngine`, and trainer/engine log-prob agreement.

    python benchmarks/gpu_check.py            # one GPU, ~1B random-weight Qwen3, a few minutes
    python benchmarks/gpu_check.py --quick    # fewer / smaller steps
    python benchmarks/gpu_check.py --cpu-smoke  # the same code on CPU with the nano model (CI)
    python benchmarks/gpu_check.py --lora 32    # the LoRA pass: an adapter trains, only it syncs

What runs (all product code):
* learner: `training.learner.learner.Learner` with the FSDP2 strategy on a 1-rank process group
  (NCCL on GPU, gloo on CPU), fp32 master weights, bf16 autocast and gradient
  checkpointing on GPU; one `train_step` (DPPO loss, AdamW, clip) per batch;
* engine: `training.inference.engine.VLLMEngine`, the dev-mode vLLM server of `tmax learn`,
  sampling through `VLLMSampler` with the sampled tokens' log-probs;
* weight sync after every step: `training.weights` with this process as learner rank 0
  (`WeightSourceMixin`, the methods a learner actor runs) and the engine's
  pause -> load -> reset -> resume (`EngineWeights`). `--transport gloo` (the default
  here) broadcasts through host memory; `nccl` needs a second GPU for the engine (NCCL
  puts one rank on one device); `object_store` is the file path of a CPU run;
* agreement: the learner's log-probs of the tokens the engine sampled, on the weights
  the engine sampled with (every step, and after the last sync).
* `--lora R`: the learner trains a rank-R LoRA adapter (`training.learner.lora`, its frozen
  base in the engine's dtype), the engine serves base + the run's start adapter, and each
  sync carries the adapter only, through the object store (`sync_bytes` against
  `full_weights_bytes`).

Without vLLM (not importable) the engine is an HF-transformers sampler in this process,
loaded by copying the learner's weights; the output says so (`engine_path`).

The last line of stdout is one JSON object with the figures. MFU = achieved training
FLOP/s / peak, with FLOPs per token = 6 * (non-embedding params incl. LM head)
+ 12 * layers * heads * head_dim * seq_len (the nanochat / PaLM estimate, recomputation
by gradient checkpointing not counted) and the peak = 989 TFLOP/s, the H100/H200 SXM
bf16 dense figure (a nominal 1 TFLOP/s on CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM, bf16 dense, no sparsity
PEAK_CPU_TFLOPS = 1.0  # nominal, only so the CPU smoke path exercises the same formula

from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402
from tmax.training.weights.learner_side import WeightSourceMixin  # noqa: E402  (cheap: no torch, no Ray)

RESULT: dict = {"ok": False}
_CLEANUP: list = []
_ARGS: list = []  # the parsed arguments, once there are: --record appends RESULT at the exit


def emit_and_exit(code: int) -> None:
    for fn in reversed(_CLEANUP):
        try:
            fn()
        except Exception:
            pass
    if _ARGS:
        try:
            record_result(_ARGS[0], RESULT)
        except Exception as e:  # the JSON line below is still the last word
            print(f"gpu_check: not recorded: {e}", file=sys.stderr, flush=True)
    print(json.dumps(RESULT, sort_keys=True), flush=True)
    os._exit(code)


def fail(message: str, code: int) -> None:
    RESULT.update(ok=False, error=message)
    print(f"gpu_check: FAILED: {message}", file=sys.stderr, flush=True)
    emit_and_exit(code)


def watchdog(limit_s: float) -> None:
    t = threading.Timer(limit_s, lambda: fail(f"hard time limit of {limit_s:g}s reached during stage "
                                              f"{RESULT.get('stage')!r}", 3))
    t.daemon = True
    t.start()


def sizes(args) -> dict:
    """Prompts x group samples, prompt and response lengths, steps, model shape."""
    if args.cpu_smoke:
        return dict(prompts=2, group=2, P=12, R=8, steps=2, spec={})
    spec = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128)  # ~0.94B parameters
    if args.quick:
        return dict(prompts=4, group=4, P=256, R=64, steps=2, spec=spec)
    return dict(prompts=8, group=8, P=512, R=256, steps=4, spec=spec)


# -- learner ---------------------------------------------------------------------------


def start_learner(model_dir: str, cpu: bool, bf16: bool, pack_length: int, lora_rank: int = 0):
    """The product `Learner` with the FSDP2 strategy on a 1-rank process group; with
    `lora_rank`, training an adapter on a base held in bf16 (GPU) or fp32."""
    import torch
    import torch.distributed as dist

    from tmax.training.learner.parallel import RankContext
    from tmax.training.net import free_port
    from tmax.training.learner.learner import Learner, LearnerConfig
    from tmax.training.learner.lora import LoraSpec
    from tmax.training.learner.parallel import FSDPDataParallel

    backend, device = ("gloo", torch.device("cpu")) if cpu else ("nccl", torch.device("cuda", 0))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=None if cpu else device)
    _CLEANUP.append(dist.destroy_process_group)
    lora = LoraSpec(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None
    cfg = LearnerConfig(lr=(1e-3 if cpu else 1e-6) * (10 if lora else 1), device=str(device), strategy="fsdp",
                        autocast="bfloat16" if bf16 and not lora else None, gradient_checkpointing=not cpu,
                        pack_length=pack_length, lora=lora, dtype="bfloat16" if bf16 and lora else "float32")
    learner = Learner(model_dir, cfg, FSDPDataParallel(RankContext(0, 1, backend, device)))
    RESULT["learner_path"] = f"tmax.training.learner.learner.Learner, FSDP2 over {backend} (1 rank)" + (
        f", LoRA rank {lora_rank} (fp32 adapter) on a frozen {cfg.dtype} base" if lora else
        ", bf16 autocast, fp32 master weights" if bf16 else ", fp32")
    return learner


class LocalSource(WeightSourceMixin):
    """This process as learner rank 0: the methods a learner actor runs in a sync."""

    def __init__(self, learner):
        self.learner = learner


# -- engines ---------------------------------------------------------------------------


class VLLMSide:
    """A real `VLLMEngine` and the weight sync into it over `transport`."""

    def __init__(self, model_dir: str, learner, transport: str, dtype: str, max_len: int):
        """`model_dir` may be a LoRA adapter: the engine then serves it on its base."""
        from tmax.training.inference.engine import VLLMEngine, VLLMSampler
        from tmax.training.engine_options import EngineOptions

        self.learner, self.transport = learner, transport
        env_gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
        if transport == "nccl":  # the engine on the second GPU: NCCL needs one device per rank
            os.environ["CUDA_VISIBLE_DEVICES"] = "1"
        # On one GPU the learner holds most of the memory.
        memory = None if learner.device.type == "cpu" else 0.35
        try:
            options = EngineOptions(max_model_len=max_len, dtype=dtype, gpu_memory_utilization=memory)
            self.engine = VLLMEngine(model_dir, options=options,
                                     work_dir=tempfile.mkdtemp(prefix="gpu-check-engine-"))
        finally:
            if env_gpu is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = env_gpu
        _CLEANUP.append(self.engine.close)
        self.sampler = VLLMSampler(self.engine.url, self.engine.served_model_name, engine=self.engine,
                                   max_model_len=self.engine.max_model_len, extra_body={"ignore_eos": True})
        self.source = LocalSource(learner)
        # A process-group receive returns only once rank 0 (this thread) has sent: the
        # engine's side runs on this thread pool, as it runs on another actor in training.
        self._receiver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-check-receive")
        if transport != "object_store":
            from tmax.training.net import free_port

            port = free_port()
            joined = self._receiver.submit(self.engine.join_weight_group, "127.0.0.1", port, 1, 2, transport, 300.0)
            self.source.join_weight_group("127.0.0.1", port, 2, transport, timeout_s=300.0)
            joined.result(timeout=360)
        RESULT["engine_path"] = f"tmax.training.inference.engine.VLLMEngine (vLLM {_version('vllm')}), weights by {transport}"

    def sync(self, version: int) -> tuple[float, int]:
        """(seconds, bytes) of one weight sync of the learner's current weights."""
        t0 = time.perf_counter()
        if self.transport == "object_store":
            weights = self.learner.named_weights()
            self.engine.push_weights(weights, version)
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        else:
            update = self.source.prepare_weights(version)
            pending = self._receiver.submit(self.engine.receive_weights, update)
            self.source.send_weights()
            pending.result(timeout=600)
            nbytes = update.total_bytes
        return time.perf_counter() - t0, nbytes

    def sample(self, prompts: list[list[int]], n: int, seed: int):
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            outs = list(pool.map(lambda i: self.sampler.sample(prompts[i], n, 1.0, 1.0, seed=seed + i),
                                 range(len(prompts))))
        return [o.ids for o in outs], [o.logprobs for o in outs], min(o.policy_version for o in outs)


class HFSide:
    """The fallback without vLLM: an HF-transformers sampler with a KV cache in this
    process, loaded by copying the learner's weights."""

    def __init__(self, model_dir: str, learner, cpu: bool):
        import torch
        from transformers import AutoModelForCausalLM

        self.learner, self.device = learner, torch.device("cpu" if cpu else "cuda")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
        self.version = -1
        RESULT["engine_path"] = "HF transformers sampler in this process (vLLM is not importable), weights copied"
        print("gpu_check: vLLM is not importable: falling back to the HF sampler", flush=True)

    def sync(self, version: int) -> tuple[float, int]:
        from tmax.training.weights.protocol import load_into

        t0 = time.perf_counter()
        weights = self.learner.named_weights()
        load_into(self.model, iter(weights.items()))
        self.version = version
        return time.perf_counter() - t0, sum(t.numel() * t.element_size() for t in weights.values())

    def sample(self, prompts: list[list[int]], n: int, seed: int):
        import torch

        g = torch.Generator(device=self.device).manual_seed(seed)
        ids = torch.tensor(prompts, device=self.device)
        out_ids, out_lp = [], []
        with torch.no_grad():
            out = self.model(input_ids=ids, use_cache=True)
            for _ in range(n):
                lp = torch.log_softmax(out.logits[:, -1].float(), -1)
                nxt = torch.multinomial(lp.exp(), 1, generator=g)
                out_ids.append(nxt[:, 0])
                out_lp.append(lp.gather(-1, nxt)[:, 0])
                out = self.model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        return torch.stack(out_ids, 1).tolist(), torch.stack(out_lp, 1).tolist(), self.version


def _version(name: str) -> str:
    try:
        return importlib.import_module(name).__version__
    except Exception:
        return "?"


# -- the check -------------------------------------------------------------------------


def build_model(spec: dict) -> str:
    from tmax.training.nano.model import NanoSpec, build_nano_model

    out = tempfile.mkdtemp(prefix="gpu-check-model-")
    _CLEANUP.append(lambda: __import__("shutil").rmtree(out, ignore_errors=True))
    build_nano_model(out, seed=0, spec=NanoSpec(**spec))
    return out


def prompt_vocab(model_dir: str, learner) -> int:
    """Random prompts draw from ids both the tokenizer (vLLM checks prompts) and the model know."""
    from transformers import AutoTokenizer

    return min(len(AutoTokenizer.from_pretrained(model_dir)), learner.vocab_size)


def agreement(learner, prompts, responses, engine_lps) -> list[float]:
    """|learner log-prob - engine log-prob| of every sampled token."""
    from tmax.agents.policy import TokenTrace
    from tmax.training.learner.packing import TrainSample

    samples = [TrainSample(TokenTrace(p, r, lp, [1] * len(r)), 0.0) for p, r, lp in zip(prompts, responses, engine_lps)]
    mine = learner.logprobs(samples)
    return [abs(a - b) for m, e in zip(mine, engine_lps) for a, b in zip(m, e)]


def run_steps(side, learner, sz: dict, vocab: int, syncs: list) -> dict:
    """Sample -> agreement -> train step -> sync, `steps` times; then a last agreement."""
    import random

    from tmax.agents.policy import TokenTrace
    from tmax.training.learner.packing import TrainSample

    rng = random.Random(1)
    n_prompts, group, P, R = sz["prompts"], sz["group"], sz["P"], sz["R"]
    acc = dict(gen_s=0.0, gen_tokens=0, learn_s=0.0, learn_tokens=0.0, diffs=[], step_diff_max=[])
    for step in range(sz["steps"] + 1):
        RESULT["stage"] = f"step {step}: sample"
        prompts = [p for p in ([rng.randrange(vocab) for _ in range(P)] for _ in range(n_prompts)) for _ in range(group)]
        t0 = time.perf_counter()
        resp, lps, version = side.sample(prompts, R, seed=1000 * (step + 1))
        acc["gen_s"] += time.perf_counter() - t0
        acc["gen_tokens"] += sum(len(r) for r in resp)
        if version != step:
            raise RuntimeError(f"engine sampled with weights version {version}, expected {step}")
        acc["engine_version"] = version
        diffs = agreement(learner, prompts, resp, lps)  # same weights on both sides
        acc["diffs"] += diffs
        acc["step_diff_max"].append(max(diffs))
        if step == sz["steps"]:
            break  # the agreement after the last sync
        RESULT["stage"] = f"step {step}: learner"
        # Synthetic verifiable reward: parity of the response; advantage = reward - group mean.
        rewards = [float(sum(r) % 2 == 0) for r in resp]
        means = [sum(rewards[i - i % group:i - i % group + group]) / group for i in range(len(rewards))]
        samples = [TrainSample(TokenTrace(p, r, lp, [1] * len(r)), rw - m)
                   for p, r, lp, rw, m in zip(prompts, resp, lps, rewards, means)]
        metrics = learner.train_step(samples)
        acc["learn_s"] += metrics["time/training"]
        acc["learn_tokens"] += metrics["learner/tokens"]
        RESULT["stage"] = f"step {step}: weight sync"
        syncs.append(side.sync(step + 1))
        print(f"gpu_check: step {step}: |dlogp| max {max(diffs):.3g}, sync {syncs[-1][0]:.3f}s", flush=True)
    return acc


def report(acc: dict, syncs: list, learner, sz: dict, cpu: bool, tol: tuple[float, float]) -> list[str]:
    cfg = learner.model.config
    n_params = sum(p.numel() for p in learner.model.parameters())
    n_embed = cfg.vocab_size * cfg.hidden_size
    T = sz["P"] + sz["R"]
    flops_per_token = 6 * (n_params - n_embed) + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * T
    peak = PEAK_CPU_TFLOPS if cpu else PEAK_BF16_TFLOPS
    achieved = flops_per_token * acc["learn_tokens"] / max(acc["learn_s"], 1e-9)
    later = syncs[1:]
    gb = later[0][1] / 1e9
    sync_mean = sum(s for s, _ in later) / len(later)
    diff_max, diff_mean = max(acc["diffs"]), sum(acc["diffs"]) / len(acc["diffs"])
    RESULT.update(
        steps=sz["steps"], params=n_params,
        sync_s_initial=round(syncs[0][0], 4), sync_s_mean=round(sync_mean, 4),
        sync_s_max=round(max(s for s, _ in later), 4), weights_gb=round(gb, 4), sync_bytes=later[0][1],
        sync_s_per_gb=round(sync_mean / max(gb, 1e-12), 3),
        learner_tokens_per_s=round(acc["learn_tokens"] / acc["learn_s"], 1),
        learner_mfu=round(achieved / (peak * 1e12), 6), mfu_peak_tflops=peak, mfu_flops_per_token=flops_per_token,
        engine_tokens_per_s=round(acc["gen_tokens"] / acc["gen_s"], 1),
        logprob_max_abs_diff=diff_max, logprob_mean_abs_diff=diff_mean,
        logprob_max_abs_diff_after_last_sync=acc["step_diff_max"][-1],
        logprob_tolerance={"max": tol[0], "mean": tol[1]},
        engine_version_after_last_sync=acc["engine_version"],
    )
    print(f"gpu_check: learner {RESULT['learner_tokens_per_s']} tok/s, MFU {RESULT['learner_mfu']:.4g}; engine "
          f"{RESULT['engine_tokens_per_s']} tok/s; sync {RESULT['sync_s_per_gb']} s/GB; |dlogp| after the last "
          f"sync max {acc['step_diff_max'][-1]:.3g}", flush=True)
    return ["trainer and engine log-probs disagree beyond tolerance"] if diff_max > tol[0] or diff_mean > tol[1] else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 small steps")
    ap.add_argument("--cpu-smoke", action="store_true", help="the nano model on CPU (CI path of this script)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--transport", choices=("gloo", "nccl", "object_store"), default="gloo",
                    help="weight transport (nccl: the engine on a second GPU)")
    ap.add_argument("--time-limit", type=float, default=540.0, help="hard limit in seconds (default 540)")
    ap.add_argument("--fp32", action="store_true", help="fp32 learner and engine on GPU: the exact agreement check")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="the LoRA pass: train a rank-R adapter, sync only it (through the object store)")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    _ARGS.append(args)
    if args.lora:
        args.transport = "object_store"  # an adapter syncs as a file, whatever the full weights use
    watchdog(args.time_limit)
    t_start = time.perf_counter()
    RESULT["stage"] = "setup"
    import torch

    cpu = args.cpu_smoke
    if not cpu and not torch.cuda.is_available():
        fail("no CUDA device visible (use --cpu-smoke on machines without a GPU)", 2)
    if args.lora and importlib.util.find_spec("vllm") is None:
        fail("--lora needs vLLM (the HF fallback sampler serves no adapter)", 2)
    if args.transport == "nccl" and (cpu or torch.cuda.device_count() < 2):
        fail("--transport nccl needs two GPUs (NCCL puts one rank on one device); use gloo", 2)
    bf16 = not cpu and not args.fp32
    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    sz = sizes(args)
    sz["steps"] = args.steps or sz["steps"]
    have_vllm = importlib.util.find_spec("vllm") is not None
    RESULT.update(mode=("cpu-smoke" if cpu else ("gpu-quick" if args.quick else "gpu")) + ("-fp32" if args.fp32 and not cpu else "")
                  + (f"-lora{args.lora}" if args.lora else ""),
                  device="cpu" if cpu else torch.cuda.get_device_name(0), torch=torch.__version__,
                  vllm=_version("vllm") if have_vllm else "not importable", transport=args.transport if have_vllm else "none",
                  batch=f"{sz['prompts']} prompts x {sz['group']} samples, prompt {sz['P']} + response {sz['R']} tokens")
    print(f"gpu_check: {RESULT['mode']} on {RESULT['device']}; vllm {RESULT['vllm']}", flush=True)
    model_dir = build_model(sz["spec"])
    RESULT["stage"] = "learner setup"
    if args.lora:  # the learner and the engine start from the same new adapter, as in `tmax learn`
        from tmax.training.learner.lora import LoraSpec, init_adapter

        model_dir = str(init_adapter(model_dir, LoraSpec(rank=args.lora, alpha=2.0 * args.lora),
                                     tempfile.mkdtemp(prefix="gpu-check-adapter-"), seed=0))
    learner = start_learner(model_dir, cpu, bf16, pack_length=sz["P"] + sz["R"], lora_rank=args.lora)
    RESULT.update(lora_rank=args.lora, full_weights_bytes=sum(  # what a full-weight sync would carry
        p.numel() * p.element_size() for n, p in learner.model.named_parameters() if "lora_" not in n))
    RESULT["stage"] = "engine start"
    if have_vllm:
        side = VLLMSide(model_dir, learner, args.transport, "bfloat16" if bf16 else "float32",
                     max(256, sz["P"] + sz["R"] + 16))  # 256: the least a tmax engine accepts
    else:
        side = HFSide(model_dir, learner, cpu)
    RESULT["stage"] = "initial sync"
    syncs = [side.sync(0)]
    acc = run_steps(side, learner, sz, prompt_vocab(model_dir, learner), syncs)
    # fp32 on both sides agrees to float rounding. bf16 cannot: the engine decodes with a KV
    # cache while the trainer runs the whole sequence, and bf16 kernels round the two
    # differently; the bound catches a missed or garbled sync (two different random
    # models differ by several nats), not bf16 noise.
    tol = (1e-4, 1e-5) if cpu else ((1e-2, 1e-3) if args.fp32 else (3.0, 0.4))
    problems = report(acc, syncs, learner, sz, cpu, tol)
    RESULT.update(ok=not problems, stage="done", wall_s=round(time.perf_counter() - t_start, 1))
    if problems:
        fail("; ".join(problems), 1)
    emit_and_exit(0)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as e:  # any failure still ends with one JSON line
        traceback.print_exc()
        fail(f"{type(e).__name__} during {RESULT.get('stage')!r}: {e}", 1)
