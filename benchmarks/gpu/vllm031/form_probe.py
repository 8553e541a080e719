"""GPU probe of the questions docs/vllm031_form.md leaves to the device, on vLLM 0.31's own functions (loaded through
the plugin's layout table), before any live run: (1) is ``linear_batch_invariant`` bitwise invariant to the row count
for each shape (0.31 picks tuned tiles by row count for some bf16 shapes on Hopper); (2) where does the RMSNorm
kernels' output for one row change with the launch's row count (0.26: below 256 rows or not); (3) does the V2
sampler's ``compute_token_logprobs`` give the same bits on bf16 logits and on their fp32 copy; (4) does torch's
``x / T`` equal vLLM's ``apply_temperature`` on fp32 logits. Writes $OUT/vllm031_form_probe.json (or ./ without OUT).
Usage (after install.sh, on the warm machine, from the project root): . benchmarks/gpu/vllm031/env.sh && python3 -m
benchmarks.gpu.vllm031.form_probe
Not yet run on a GPU."""

import importlib
import json
import os

import torch

from bloggap_plugin.core.vllm.kernels import vllm_layout

SHAPES = {  # (N, K) of each linear: out x in
    "hopper_tuned": [(2048, 2048), (4096, 2048), (12288, 2048), (2048, 6144), (151936, 2048)],
    "llama-1.56b-v49k": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (49152, 2048)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
}
ROWS = [1, 3, 8, 16, 17, 32, 64, 100, 256, 512, 1024, 2048, 4096]
LAUNCH = [1, 2, 8, 16, 64, 128, 255, 256, 257, 512, 1024]


def linear_invariance(bi, gen) -> dict:
    """Per shape: the row counts M whose ``linear(x[:M])`` differs from the first M rows of ``linear(x)`` (M=4096)."""
    out = {}
    for family, shapes in SHAPES.items():
        for n, k in shapes:
            x = torch.randn(max(ROWS), k, device="cuda", generator=gen).bfloat16()
            w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
            full = bi.linear_batch_invariant(x, w)
            out[f"{family} {n}x{k}"] = [m for m in ROWS if not torch.equal(bi.linear_batch_invariant(x[:m], w), full[:m])]
    return out


def _norm_row0(name: str, bi, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Row 0 of norm ``name`` launched over all of ``x``'s rows."""
    from vllm import _custom_ops as ops

    if name == "rms_norm_batch_invariant":
        return bi.rms_norm_batch_invariant(x, w, 1e-5)[0]
    y = x.clone()
    if name == "_C.rms_norm":
        ops.rms_norm(y, x.contiguous(), w, 1e-5)
    else:
        ops.fused_add_rms_norm(y, torch.zeros_like(x), w, 1e-5)
    return y[0]


def norm_launch_rule(bi, gen) -> dict:
    """Per hidden size and kernel: the launch sizes (rows) grouped by the bits of row 0's output."""
    out = {}
    for hidden in (576, 2048):
        x = torch.randn(max(LAUNCH), hidden, device="cuda", generator=gen).bfloat16()
        w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
        for name in ("_C.rms_norm", "_C.fused_add_rms_norm", "rms_norm_batch_invariant"):
            groups: list[tuple[torch.Tensor, list[int]]] = []
            for rows in LAUNCH:
                row = _norm_row0(name, bi, x[:rows], w)
                match = next((g for g in groups if torch.equal(g[0], row)), None)
                if match is None:
                    groups.append((row, [rows]))
                else:
                    match[1].append(rows)
            out[f"{name} hidden {hidden}"] = [g[1] for g in groups]
    return out


def sampler_pieces(layout, gen) -> dict:
    """(3) the log-prob kernel on bf16 logits and on their fp32 copy; (4) torch's ``x / T`` against vLLM's
    ``apply_temperature`` (share of equal fp32 values) for a few temperatures."""
    compute_token_logprobs = importlib.import_module(layout.logprob).compute_token_logprobs
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature

    rows, vocab = 256, 49152
    logits = (3 * torch.randn(rows, vocab, device="cuda", generator=gen)).bfloat16()
    tokens = torch.randint(0, vocab, (rows, 1), device="cuda", generator=gen)
    out = {"logprob_bf16_equals_fp32_copy": torch.equal(compute_token_logprobs(logits, tokens),
                                                        compute_token_logprobs(logits.float(), tokens))}
    for t in (0.7, 0.9, 1.3):
        vllm_scaled = logits.float()
        apply_temperature(vllm_scaled, torch.arange(rows, dtype=torch.int32, device="cuda"),
                          torch.full((rows,), t, dtype=torch.float32, device="cuda"))
        out[f"temperature {t}: share equal to torch x / T"] = (vllm_scaled == logits.float() / t).float().mean().item()
        out[f"temperature {t}: share equal to torch x * (1/T)"] = (
            vllm_scaled == logits.float() * (1 / t)).float().mean().item()
    return out


def main() -> None:
    version, layout = vllm_layout()
    print("vLLM", version, "layout", layout)
    bi = importlib.import_module(layout.batch_invariant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"vllm": version, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
              "linear_rows_not_invariant": linear_invariance(bi, gen), "norm_launch_groups": norm_launch_rule(bi, gen),
              "sampler": sampler_pieces(layout, gen)}
    path = os.path.join(os.environ.get("OUT", "."), "vllm031_form_probe.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    print("FORM_PROBE written", path)


if __name__ == "__main__":
    main()
