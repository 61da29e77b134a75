"""Why a plain HF sdpa forward replays slower than eager and not bit-equal (docs/graphs.md has the findings).

A Qwen2-7B-shaped decoder (hidden 3584, 28 heads, 4 KV heads, 4 layers, random bf16 weights), its forward
over [T, H] embeddings in several forms, captured by hand (one side stream, warm-up, capture) and compared
with eager at 64 / 1024 / 4096 tokens: equality, min of 5 alternating rounds, and the attention kernel each
runs (torch.profiler). Then, each in a fresh process, the capture cost of today's runner.
"""
import json
import os
import subprocess
import sys
import time

import torch

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # the checkout's slabstage


def build(layers=4, attn="sdpa"):
    import transformers as tf
    cfg = tf.Qwen2Config(vocab_size=4096, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                         rms_norm_eps=1e-6)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(DEV):
        model = tf.Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def forwards(model):
    import transformers as tf
    import slabstage.hf as sshf
    base = model.model

    def plain(v):
        return base(inputs_embeds=v["input_embeds"][None], position_ids=v["positions"][None],
                    use_cache=False).last_hidden_state[0]

    def no_position_ids(v):
        return base(inputs_embeds=v["input_embeds"][None], use_cache=False).last_hidden_state[0]

    def mask4d(v):
        T = v["input_embeds"].shape[0]
        r = torch.arange(T, device=DEV)
        mask = (r[None, :] <= r[:, None])[None, None]
        return base(inputs_embeds=v["input_embeds"][None], position_ids=v["positions"][None], attention_mask=mask,
                    use_cache=False).last_hidden_state[0]

    def cache(v):
        return base(inputs_embeds=v["input_embeds"][None], position_ids=v["positions"][None],
                    past_key_values=tf.DynamicCache(config=model.config), use_cache=True).last_hidden_state[0]

    return dict(plain=plain, no_position_ids=no_position_ids, mask4d=mask4d, cache=cache,
                prefill_forward=sshf.prefill_forward(model))


def views(T, g):
    return dict(input_embeds=torch.randn(T, 3584, generator=g, device=DEV).to(torch.bfloat16),
                positions=torch.arange(T, device=DEV), seq_lens=torch.tensor([T], dtype=torch.int32, device=DEV),
                extend_start_loc=torch.zeros(1, dtype=torch.int32, device=DEV),
                num_tokens_non_padded=torch.tensor([T], dtype=torch.int32, device=DEV))


def timed(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def attention_kernels(fn):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if any(k in e.key.lower() for k in ("sdpa", "fmha", "flash", "attention", "cudnn", "efficient")):
            rows.append((e.key[:110], round(e.device_time_total if hasattr(e, "device_time_total")
                                            else e.cuda_time_total, 1)))
    return rows


def equality_and_timing():
    model = build()
    fw = forwards(model)
    g = torch.Generator(device=DEV).manual_seed(1)
    out = {}
    stream = torch.cuda.Stream()
    for T in (64, 1024, 4096):
        v = views(T, g)
        for name, f in fw.items():
            with torch.no_grad():
                e1 = f(v).clone()
                e2 = f(v).clone()
                stream.wait_stream(torch.cuda.current_stream())
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    f(v)
                    with torch.cuda.graph(graph, stream=stream):
                        static = f(v)
                torch.cuda.current_stream().wait_stream(stream)
                graph.replay()
                torch.cuda.synchronize()
                eager_t, replay_t = [], []
                for _ in range(5):
                    eager_t.append(timed(lambda f=f, v=v: f(v)))
                    replay_t.append(timed(graph.replay))
                row = dict(eager_deterministic=torch.equal(e1, e2), replay_equal=torch.equal(static, e1),
                           max_abs=(static.float() - e1.float()).abs().max().item(),
                           eager_us=min(eager_t), replay_us=min(replay_t),
                           replay_over_eager_speed=min(eager_t) / min(replay_t))
                if T in (1024, 4096) and name in ("plain", "mask4d", "cache", "prefill_forward"):
                    row["eager_attention"] = attention_kernels(lambda f=f, v=v: f(v))
                    row["replay_attention"] = attention_kernels(graph.replay)
                out[f"{name}@{T}"] = row
                print(f"{name:16s} T={T:5d} det={row['eager_deterministic']!s:5s} equal={row['replay_equal']!s:5s} "
                      f"maxabs={row['max_abs']:.2e} eager {row['eager_us']:9.1f} replay {row['replay_us']:9.1f} "
                      f"x{row['replay_over_eager_speed']:.2f}", flush=True)
                for k in ("eager_attention", "replay_attention"):
                    if k in row:
                        print("   ", k, row[k], flush=True)
                del graph, static
        torch.cuda.empty_cache()
    return out


def capture_cost(variant):
    """Fresh process: today's PrefillGraphRunner, default ladder to 4096, with ``variant``'s forward."""
    import slabstage as ss
    t0 = time.perf_counter()
    model = build()
    build_s = time.perf_counter() - t0
    f = forwards(model)[variant]
    calls = []

    def timed_forward(v):
        t = time.perf_counter()
        r = f(v)
        calls.append((v["input_embeds"].shape[0], torch.cuda.is_current_stream_capturing(),
                      time.perf_counter() - t))
        return r

    buffers = ss.StagingBuffers.allocate(max_num_tokens=4096, max_batch_size=8, embed_width=3584,
                                         embed_dtype=torch.bfloat16, device=DEV)
    runner = ss.PrefillGraphRunner(timed_forward, buffers, progress=False)
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_reserved()
    t = time.perf_counter()
    with torch.no_grad():
        runner.capture()
    total = time.perf_counter() - t
    warm = sum(c[2] for c in calls if not c[1])
    cap = sum(c[2] for c in calls if c[1])
    return dict(variant=variant, buckets=len(runner.buckets), capture_s=total, per_bucket_s=total / len(runner.buckets),
                forward_warmup_s=warm, forward_in_capture_s=cap, reported_capture_s=runner.capture_seconds,
                capture_mib=runner.capture_bytes / 2**20, mem_reserved_before_mib=mem0 / 2**20,
                first_warmup_s=next(c[2] for c in calls if not c[1]), model_build_s=build_s)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "capture":
        print("RESULT " + json.dumps(capture_cost(sys.argv[2])), flush=True)
        sys.exit(0)
    result = dict(env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name()))
    import transformers
    result["env"]["transformers"] = transformers.__version__
    result["equality"] = equality_and_timing()
    caps = []
    for variant in ("prefill_forward", "plain", "cache"):
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "capture", variant], capture_output=True,
                           text=True, timeout=240)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        caps.append(json.loads(line[7:]) if line else dict(variant=variant, error=p.stderr[-2000:]))
        print(caps[-1], flush=True)
    result["capture"] = caps
    json.dump(result, open(os.path.join(OUT, "investigate_capture.json"), "w"), indent=1)
