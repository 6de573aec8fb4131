"""Single-GPU check of the scale-out path: FSDP2 learner + DPPO steps + weight sync to an
inference engine in a second process + trainer/engine log-prob agreement.

    python benchmarks/gpu_check.py            # H200, ~1B random-weight Qwen3, a few minutes
    python benchmarks/gpu_check.py --quick    # fewer / smaller steps
    python benchmarks/gpu_check.py --cpu-smoke  # the same code on CPU with a tiny model (CI)

What runs:
* learner: a Qwen3-shaped model (random init, no download) sharded with FSDP2 on a
  1-rank process group (`training.distributed`), bf16 compute with fp32 master weights and
  an fp32 LM head, gradient checkpointing; DPPO loss from `training.dppo` with the global
  token denominator; AdamW, grad clip 1.0, one optimizer step per batch;
* engine: a second process on the same GPU holding a bf16 copy (fp32 LM head) that samples
  tokens with their log-probs using a KV cache;
* weight sync after every step: the learner gathers full weights, packs them into per-dtype
  buckets (the `training.distributed` manifest protocol) and hands the buckets over as
  CUDA IPC handles through torch.multiprocessing. On one GPU NCCL cannot be used: it needs
  one device per rank, and learner and engine share the device. Multi-GPU runs use the
  NCCL `WeightGroup` with the same manifest and buckets;
* agreement: the trainer's log-probs of the engine's sampled tokens, after every sync,
  against the engine's own (max |delta| is reported; a missed sync shows up as a jump).

The last line of stdout is one JSON object with the figures. MFU = achieved training
FLOP/s / peak, with FLOPs per token = 6 * (non-embedding params incl. LM head)
+ 12 * layers * heads * head_dim * seq_len (the nanochat / PaLM estimate, recomputation by
gradient checkpointing not counted) and the peak = 989 TFLOP/s, the H100/H200 SXM bf16
dense figure.

vLLM and Ray are optional here: the GPU machine this targets has neither, so the engine is
an HF-transformers sampler in a torch.multiprocessing process; the JSON says which path ran.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM, bf16 dense, no sparsity
PEAK_CPU_TFLOPS = 1.0  # nominal, only so the CPU smoke path exercises the same formula

RESULT: dict = {"ok": False}
_ENGINE_PROC = None


def emit_and_exit(code: int) -> None:
    print(json.dumps(RESULT, sort_keys=True), flush=True)
    if _ENGINE_PROC is not None and _ENGINE_PROC.is_alive():
        _ENGINE_PROC.kill()
    os._exit(code)


def watchdog(limit_s: float) -> None:
    def fire() -> None:
        RESULT["ok"] = False
        RESULT["error"] = f"hard time limit of {limit_s:g}s reached during stage {RESULT.get('stage')!r}"
        print(f"gpu_check: FAILED: {RESULT['error']}", file=sys.stderr, flush=True)
        emit_and_exit(3)

    t = threading.Timer(limit_s, fire)
    t.daemon = True
    t.start()


def model_config(kind: str):
    from transformers import Qwen3Config

    if kind == "tiny":  # CPU smoke: hidden 64, 2 layers, head_dim 32, vocab 300
        return Qwen3Config(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        )
    # ~0.94B parameters: 16 Qwen3 blocks of width 2048 (GQA 16/8, head_dim 128) and an
    # untied 32k vocabulary.
    return Qwen3Config(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
    )


# -- engine process --------------------------------------------------------------------


def engine_main(cfg_dict: dict, device: str, bf16: bool, cmd_q, res_q) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from training import distributed as D

    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        cfg = Qwen3Config(**cfg_dict)
        cfg._attn_implementation = "sdpa"
        if device.startswith("cuda") and not bf16:
            # The exact-agreement mode: no TF32 shortcuts on either side.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
        if bf16:
            model.to(torch.bfloat16)
            model.lm_head.float()  # fp32 LM head, as the trainer
        model.eval()
        version = -1
        res_q.put(("ready", {"pid": os.getpid()}))

        def logits_of(hidden):
            return torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())

        while True:
            cmd = cmd_q.get()
            op = cmd[0]
            if op == "stop":
                res_q.put(("stopped", version))
                return
            if op == "weights":
                _, update, flats = cmd
                t0 = time.perf_counter()
                pairs = (p for b, flat in enumerate(flats) for p in D.unpack_bucket(update, b, flat))
                n = D.load_into(model, pairs)
                del flats, pairs  # drop the IPC views before acknowledging
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                version = update.version
                res_q.put(("synced", version, n, time.perf_counter() - t0))
            elif op == "sample":
                _, prompts, max_new, seed = cmd
                t0 = time.perf_counter()
                g = torch.Generator(device=device).manual_seed(seed)
                ids = prompts.to(device)
                out_ids, out_lp = [], []
                with torch.no_grad():
                    out = model.model(input_ids=ids, use_cache=True)
                    past, hidden = out.past_key_values, out.last_hidden_state[:, -1]
                    for _ in range(max_new):
                        lp = torch.log_softmax(logits_of(hidden), -1)  # temperature 1
                        nxt = torch.multinomial(lp.exp(), 1, generator=g)
                        out_ids.append(nxt[:, 0])
                        out_lp.append(lp.gather(-1, nxt)[:, 0])
                        out = model.model(input_ids=nxt, past_key_values=past, use_cache=True)
                        past, hidden = out.past_key_values, out.last_hidden_state[:, -1]
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                res_q.put(
                    (
                        "sampled",
                        torch.stack(out_ids, 1).cpu(),
                        torch.stack(out_lp, 1).float().cpu(),
                        version,
                        time.perf_counter() - t0,
                    )
                )
            else:
                res_q.put(("error", f"unknown command {op!r}"))
    except Exception:
        res_q.put(("error", traceback.format_exc()))


# -- learner ---------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 small steps")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (CI path of this script)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--time-limit", type=float, default=540.0, help="hard limit in seconds (default 540)")
    ap.add_argument("--no-fsdp", action="store_true", help="plain module instead of FSDP2 (fallback)")
    ap.add_argument(
        "--fp32", action="store_true",
        help="fp32 learner and engine, TF32 off: the exact weight-sync / alignment check (tight tolerance)",
    )
    args = ap.parse_args()
    watchdog(args.time_limit)
    t_start = time.perf_counter()
    RESULT["stage"] = "import"

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from training import distributed as D
    from training.dppo import LossConfig, policy_loss

    cpu = args.cpu_smoke
    if not cpu and not torch.cuda.is_available():
        RESULT["error"] = "no CUDA device visible (use --cpu-smoke on machines without a GPU)"
        print(f"gpu_check: FAILED: {RESULT['error']}", file=sys.stderr)
        emit_and_exit(2)
    device = "cpu" if cpu else "cuda:0"
    # bf16 = the production path (bf16 compute, fp32 LM head on both sides).
    bf16 = not cpu and not args.fp32
    if not cpu and args.fp32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    # Sizes: prompts x group samples, prompt and response lengths, micro-batch.
    if cpu:
        n_prompts, group, P, R, micro, steps = 2, 2, 12, 6, 2, 2
    elif args.quick:
        n_prompts, group, P, R, micro, steps = 4, 4, 256, 64, 8, 2
    else:
        n_prompts, group, P, R, micro, steps = 8, 8, 512, 256, 8, 4
    steps = args.steps or steps
    B = n_prompts * group
    RESULT.update(
        mode=("cpu-smoke" if cpu else ("gpu-quick" if args.quick else "gpu")) + ("-fp32" if args.fp32 and not cpu else ""),
        device=torch.cuda.get_device_name(0) if not cpu else "cpu",
        torch=torch.__version__,
        vllm="importable, not used by this check" if importlib.util.find_spec("vllm") else "not importable",
        ray="importable, not used by this check" if importlib.util.find_spec("ray") else "not importable",
        engine_path="torch.multiprocessing process, HF transformers sampler with KV cache"
        + (", weights via shared memory" if cpu else ", weights via CUDA IPC handles"),
        batch=f"{n_prompts} prompts x {group} samples, prompt {P} + response {R} tokens",
    )
    print(f"gpu_check: {RESULT['mode']} on {RESULT['device']}; vllm {RESULT['vllm']}; ray {RESULT['ray']}", flush=True)

    # -- learner: 1-rank process group + FSDP2 ----------------------------------------
    RESULT["stage"] = "learner setup"
    cfg = model_config("tiny" if cpu else "1b")
    cfg._attn_implementation = "sdpa"
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)  # fp32 master weights
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel()
    RESULT["params"] = n_params
    if not cpu:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    backend = "gloo" if cpu else "nccl"
    ctx = D.RankContext(0, 1, "none", torch.device(device))
    if not args.no_fsdp:
        try:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{D.free_port()}", rank=0, world_size=1,
                device_id=torch.device(device) if not cpu else None,
            )
            ctx = D.RankContext(0, 1, backend, torch.device(device))
            model = D.shard_model(model, ctx, bf16=bf16)
            RESULT["learner_path"] = f"FSDP2 over {backend} (1 rank)" + (", bf16 compute, fp32 LM head" if bf16 else ", fp32")
        except Exception as e:
            # Fall back so the rest of the check still yields figures; say so.
            RESULT["learner_path"] = f"plain module (FSDP2 setup failed: {type(e).__name__}: {e})"
            print(f"gpu_check: WARNING: {RESULT['learner_path']}", file=sys.stderr, flush=True)
            ctx = D.RankContext(0, 1, "none", torch.device(device))
    else:
        RESULT["learner_path"] = "plain module (--no-fsdp)"
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if bf16 and ctx.backend == "none"
        else torch.autocast("cpu", enabled=False)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6 if not cpu else 1e-3, weight_decay=0.0)
    loss_cfg = LossConfig(delta=0.1)

    def token_logprobs(ids: torch.Tensor) -> torch.Tensor:
        """log pi of ids[:, 1:] (fp32 logits and log-softmax)."""
        if ctx.backend != "none":
            # Through the FSDP root (its hooks unshard the root-level parameters); the
            # LM-head unit's fp32 policy casts the hidden states up, so logits are fp32.
            logits = model(input_ids=ids).logits
        else:
            with autocast:
                hidden = model.model(input_ids=ids).last_hidden_state
            logits = model.lm_head(hidden.float())  # fp32 LM head outside autocast
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]

    def sync_weights(version: int) -> float:
        t0 = time.perf_counter()
        full = D.full_weights(model, ctx)
        # Engine dtypes: bf16 blocks and embeddings, fp32 LM head.
        w = {k: (v.float() if k.startswith("lm_head") or not bf16 else v.to(torch.bfloat16)) for k, v in full.items()}
        update = D.make_update(w, version, "ipc", bucket_mb=1024)
        tensors = list(w.values())
        flats = [D.pack_bucket([tensors[i] for i in idx]) for _, idx in update.buckets]
        if cpu:
            for f in flats:
                f.share_memory_()
        cmd_q.put(("weights", update, flats))
        msg = get(res_q, "synced")
        # The engine has copied the buckets: only now may the learner free them (CUDA IPC
        # memory must outlive every consumer's use).
        del flats, tensors, w, full
        if msg[1] != version:
            raise RuntimeError(f"engine acknowledged weights version {msg[1]}, expected {version}")
        return time.perf_counter() - t0

    # -- engine process ----------------------------------------------------------------
    RESULT["stage"] = "engine start"
    mpc = mp.get_context("spawn")
    cmd_q, res_q = mpc.Queue(), mpc.Queue()
    global _ENGINE_PROC
    _ENGINE_PROC = mpc.Process(target=engine_main, args=(cfg.to_dict(), device, bf16, cmd_q, res_q), daemon=True)
    _ENGINE_PROC.start()

    def get(q, expect: str, timeout: float = 300.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = q.get(timeout=1.0)
            except Exception:
                if not _ENGINE_PROC.is_alive():
                    raise RuntimeError(f"engine process died (exit code {_ENGINE_PROC.exitcode}) while waiting for {expect!r}")
                continue
            if msg[0] == "error":
                raise RuntimeError(f"engine failed:\n{msg[1]}")
            if msg[0] != expect:
                raise RuntimeError(f"engine protocol: expected {expect!r}, got {msg[0]!r}")
            return msg
        raise TimeoutError(f"engine did not answer {expect!r} within {timeout:g}s")

    get(res_q, "ready")
    RESULT["stage"] = "initial sync"
    syncs = [sync_weights(0)]

    # -- steps -------------------------------------------------------------------------
    g = torch.Generator().manual_seed(1)
    T = P + R
    flops_per_token = 6 * (n_params - n_embed) + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * T
    peak = PEAK_CPU_TFLOPS if cpu else PEAK_BF16_TFLOPS
    learn_s = learn_tokens = gen_s = gen_tokens = 0.0
    diffs_max, diffs_mean, kept = [], [], []
    engine_version = 0
    for step in range(steps):
        RESULT["stage"] = f"step {step}: sample"
        prompts = torch.randint(0, cfg.vocab_size, (n_prompts, P), generator=g).repeat_interleave(group, 0)
        cmd_q.put(("sample", prompts, R, 1000 + step))
        _, resp, eng_lp, eng_version, dt = get(res_q, "sampled")
        if eng_version != step:
            raise RuntimeError(f"engine sampled with weights version {eng_version}, expected {step}")
        gen_s += dt
        gen_tokens += B * R
        ids = torch.cat([prompts, resp], 1)
        # Synthetic verifiable reward: parity of the response; advantages R - group mean.
        reward = (resp.sum(1) % 2 == 0).float()
        adv = reward - reward.view(n_prompts, group).mean(1).repeat_interleave(group)

        RESULT["stage"] = f"step {step}: learner"
        if not cpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        mask = torch.zeros(B, T - 1)
        mask[:, P - 1 :] = 1.0  # response tokens (position t predicts ids[t + 1])
        old = torch.zeros(B, T - 1)
        old[:, P - 1 :] = eng_lp
        n_tokens = D.global_count(float(mask.sum()), ctx)
        opt.zero_grad(set_to_none=True)
        stats_max, stats_sum, stats_n, kept_sum = 0.0, 0.0, 0.0, 0.0
        for lo in range(0, B, micro):
            sl = slice(lo, lo + micro)
            new = token_logprobs(ids[sl].to(device))
            m, o = mask[sl].to(device), old[sl].to(device)
            a = adv[sl, None].expand_as(m).to(device)
            loss, st = policy_loss(new, o, a, m, loss_cfg, denominator=float(n_tokens))
            (loss * ctx.grad_scale).backward()
            stats_max = max(stats_max, st.diff_max)
            stats_sum += st.diff_sum
            stats_n += st.tokens
            kept_sum += st.kept
        D.clip_grad_norm(model, 1.0)
        opt.step()
        if not cpu:
            torch.cuda.synchronize()
        learn_s += time.perf_counter() - t0
        learn_tokens += B * T
        # The loss forward ran on the weights the engine sampled with: its |log pi - log mu|
        # is the trainer/engine mismatch of this step.
        diffs_max.append(stats_max)
        diffs_mean.append(stats_sum / max(stats_n, 1.0))
        kept.append(kept_sum / max(stats_n, 1.0))

        RESULT["stage"] = f"step {step}: weight sync"
        syncs.append(sync_weights(step + 1))
        engine_version = step + 1
        print(
            f"gpu_check: step {step}: |dlogp| max {stats_max:.3g} mean {diffs_mean[-1]:.3g}, kept {kept[-1]:.3f}, "
            f"sync {syncs[-1]:.3f}s",
            flush=True,
        )

    # After the last sync: the engine's log-probs of fresh samples must match the updated
    # learner (the check that the last push landed).
    RESULT["stage"] = "final agreement"
    prompts = torch.randint(0, cfg.vocab_size, (n_prompts, P), generator=g).repeat_interleave(group, 0)
    cmd_q.put(("sample", prompts, R, 99))
    _, resp, eng_lp, eng_version, _ = get(res_q, "sampled")
    with torch.no_grad():
        mine = torch.cat([token_logprobs(torch.cat([prompts, resp], 1)[sl].to(device)) for sl in
                          (slice(i, i + micro) for i in range(0, B, micro))])[:, P - 1 :].float().cpu()
    final = (mine - eng_lp).abs()
    diffs_max.append(float(final.max()))
    diffs_mean.append(float(final.mean()))
    cmd_q.put(("stop",))
    get(res_q, "stopped", timeout=60)
    _ENGINE_PROC.join(timeout=30)
    if ctx.backend != "none":
        dist.destroy_process_group()

    # fp32 on both sides must agree to float noise. The bf16 path cannot: the engine decodes
    # with a KV cache (one-token steps) while the trainer runs the whole sequence, and bf16
    # kernels round the two differently; on a random-weight 16-layer model that measured
    # ~0.1-0.2 nats mean. Its bound catches a missed or garbled sync (two different
    # random models differ by several nats), not bf16 noise.
    tol_max, tol_mean = (1e-4, 1e-5) if cpu else ((1e-2, 1e-3) if args.fp32 else (3.0, 0.4))
    achieved = flops_per_token * learn_tokens / max(learn_s, 1e-9)
    RESULT.update(
        steps=steps,
        engine_version_after_last_sync=eng_version,
        sync_s_initial=round(syncs[0], 4),
        sync_s_mean=round(sum(syncs[1:]) / len(syncs[1:]), 4),
        sync_s_max=round(max(syncs[1:]), 4),
        weights_gb=round(sum(p.numel() for p in model.parameters()) * 2 / 1e9, 3),
        learner_tokens_per_s=round(learn_tokens / learn_s, 1),
        learner_step_s_mean=round(learn_s / steps, 3),
        learner_mfu=round(achieved / (peak * 1e12), 6),
        mfu_peak_tflops=peak,
        mfu_flops_per_token=flops_per_token,
        engine_tokens_per_s=round(gen_tokens / gen_s, 1),
        logprob_max_abs_diff=max(diffs_max),
        logprob_mean_abs_diff=max(diffs_mean),
        logprob_tolerance={"max": tol_max, "mean": tol_mean},
        dppo_mask_frac_kept=round(min(kept), 4),
        wall_s=round(time.perf_counter() - t_start, 1),
    )
    problems = []
    if RESULT["logprob_max_abs_diff"] > tol_max or RESULT["logprob_mean_abs_diff"] > tol_mean:
        problems.append("trainer and engine log-probs disagree beyond tolerance")
    if eng_version != steps:
        problems.append(f"engine ended on weights version {eng_version}, expected {steps}")
    RESULT["ok"] = not problems
    RESULT["stage"] = "done"
    if problems:
        RESULT["error"] = "; ".join(problems)
        print(f"gpu_check: FAILED: {RESULT['error']}", file=sys.stderr, flush=True)
    emit_and_exit(0 if RESULT["ok"] else 1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as e:  # any failure still ends with one JSON line
        RESULT["ok"] = False
        RESULT["error"] = f"{type(e).__name__} during {RESULT.get('stage')!r}: {e}"
        traceback.print_exc()
        print(f"gpu_check: FAILED: {RESULT['error']}", file=sys.stderr, flush=True)
        emit_and_exit(1)
