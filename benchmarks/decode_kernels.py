"""Decode-step kernels of Qwen2.5-0.5B's shape on CUDA, one at a time: matrix products and attention.

Matrix products (default): how close each runs to the H200's limits, per shape.

A decode step of Qwen2.5-0.5B at 256 rows multiplies [256, K] activations by five weight shapes (fused
qkv, o, fused gate/up, down, lm_head). This script replays each product 200 times inside one CUDA graph
(so launch overhead is out) and prints microseconds per call for cuBLAS (`F.linear` and, for the two
products that accumulate into the residual, `addmm_`), the same with cuBLASLt preferred, and an
autotuned Triton kernel, beside the floor set by the larger of compute (989 TFLOP/s dense bf16) and
weight reads (4.8 TB/s):

    python benchmarks/decode_kernels.py --rows 256

Attention (`--attention`): the Triton decode attention (`decode_attention.py`) over a grid of tile
widths, warps, pipeline stages and splits, at 256 rows, 2 kv heads of 7 query heads, head size 64 and a
few context lengths; prints each configuration's microseconds and the fastest per length beside the
module's defaults:

    python benchmarks/decode_kernels.py --attention

Paged attention (`--paged`): the engine's decode attention step (`attention_step.py`) over contiguous
slots and over block tables of 16 and 64 tokens (blocks scattered at random), at 256 rows x 2k and 8k
columns and 16 rows x 32k (split-K), with the bytes it reads against 4.8 TB/s:

    python benchmarks/decode_kernels.py --paged

Attention step settings per model shape (`--step-sweep`): the paged attention step with the row scale
folded in (as the engine runs it) over tile widths, warps, pipeline stages and split counts, at the
shapes of Qwen2.5-0.5B (14 / 2 heads of 64), Qwen2.5-1.5B (12 / 2 of 128) and Qwen2.5-VL-3B (16 / 2 of
128, 64 rows: 8 images x 8 samples); prints the engine's choice and the fastest five per shape:

    python benchmarks/decode_kernels.py --step-sweep

Split-K matrix products (`--split-k`): cuBLAS (`torch.mm`, `addmm_`) against a Triton product split
over K into 1-8 float32 partials that a second kernel sums in order (the residual added there), at the
small products of the 0.5B and 1.5B decode steps:

    python benchmarks/decode_kernels.py --split-k --rows 256
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = {  # name: (K, N) of Qwen2.5-0.5B
    "qkv": (896, 1152),
    "o": (896, 896),
    "gate_up": (896, 9728),
    "down": (4864, 896),
    "lm_head": (896, 151936),
}


def graph_time_us(fn, reps: int = 200) -> float:
    """Microseconds per call of `fn` replayed `reps` times in one captured graph (median of 5 replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[2]


def triton_linear():
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_stages=st, num_warps=wp)
        for bm in (64, 128)
        for bn in (32, 64, 128)
        for bk in (64, 128)
        for st in (3, 4)
        for wp in (4, 8)
    ]

    @triton.autotune(configs=configs, key=["M", "N", "K"])
    @triton.jit
    def kernel(
        a_ptr, w_ptr, c_ptr, M, N, K, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptr + rn[None, :] * K + (k0 + rk)[:, None], mask=rn[None, :] < N, other=0.0)
            acc = tl.dot(a, w, acc)
        ptrs = c_ptr + rm[:, None] * N + rn[None, :]
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        if ACC:
            acc += tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=inside)

    def run(a, w, c, accumulate: bool) -> None:
        M, K = a.shape
        N = w.shape[0]
        grid = lambda meta: (triton.cdiv(M, meta["BM"]), triton.cdiv(N, meta["BN"]))  # noqa: E731
        kernel[grid](a, w, c, M, N, K, ACC=accumulate)

    return run


def attention_sweep(rows: int) -> None:
    from relax.backends.inference.embedded.model import decode_attention as da

    Hk, R, D, slots, max_len = 2, 7, 64, rows, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    k_buf = torch.randn(slots, Hk, max_len, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v_buf = torch.randn(slots, Hk, max_len, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(rows, Hk, R, D, device="cuda", dtype=torch.bfloat16, generator=g)
    for L in (160, 256, 384):
        lengths = torch.randint(L - 32, L + 1, (rows,), device="cuda", generator=g, dtype=torch.int32)
        k, v = k_buf[:, :, :L], v_buf[:, :, :L]
        ref = da._launch(q, k, v, lengths, 0.125, 1)
        results = []
        for block in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    for splits in (1, 2):
                        cfg = {"block": block, "warps": warps, "stages": stages, "splits": splits}
                        try:
                            out = da._launch(q, k, v, lengths, 0.125, splits, block, warps, stages)
                            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
                            us = graph_time_us(
                                lambda c=cfg, k=k, v=v, n=lengths: da._launch(
                                    q, k, v, n, 0.125, c["splits"], c["block"], c["warps"], c["stages"]
                                ),
                                reps=100,
                            )
                        except Exception as e:  # noqa: BLE001 - a configuration that does not compile
                            print(json.dumps({"L": L, **cfg, "error": str(e)[:120]}), flush=True)
                            continue
                        results.append((round(us, 2), cfg))
        results.sort(key=lambda r: r[0])
        default = next(
            us
            for us, c in results
            if (c["block"], c["warps"], c["stages"]) == (da.BLOCK_N, da.WARPS, da.STAGES)
            and c["splits"] == da.splits_for(rows, Hk, L)
        )
        print(json.dumps({"L": L, "default_us": default, "best": results[:6]}), flush=True)


def paged_case(rows: int, L: int, g: torch.Generator) -> dict:
    """One (rows, columns) case of `--paged`: microseconds over slots and over pages of 16 and 64."""
    from relax.backends.inference.embedded.model.attention_step import attention_step

    Hq, Hk, D, C = 14, 2, 64, L + 64
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    qk = torch.randn(rows, Hq + Hk, D, generator=g, **bf16)
    v = torch.randn(rows, Hk, D, generator=g, **bf16)
    cos, sin = torch.ones(rows, D, **bf16), torch.zeros(rows, D, **bf16)
    lengths = torch.full((rows,), L, device="cuda", dtype=torch.int32)
    idx = torch.arange(rows, device="cuda")
    gbytes = 2 * rows * L * Hk * D * 2 / 1e9  # keys and values read
    row = {"rows": rows, "columns": L, "kv_gb": round(gbytes, 3), "floor_us": round(gbytes / 4.8e3 * 1e6, 1)}
    k_buf = torch.randn(rows, Hk, C, D, generator=g, **bf16)
    v_buf = torch.randn_like(k_buf)
    row["slots_us"] = round(
        graph_time_us(
            lambda kb=k_buf, vb=v_buf: attention_step(qk, v, cos, sin, kb, vb, idx, lengths, L, 0.125), 20
        ),
        1,
    )
    del k_buf, v_buf
    for page in (16, 64):
        nb = -(-C // page)
        pool_k = torch.randn(rows * nb + 1, Hk, page, D, generator=g, **bf16)
        pool_v = torch.randn_like(pool_k)
        table = (torch.randperm(rows * nb, device="cuda", generator=g) + 1).view(rows, nb).to(torch.int32)

        def paged(pk=pool_k, pv=pool_v, t=table) -> torch.Tensor:
            return attention_step(qk, v, cos, sin, pk, pv, idx, lengths, L, 0.125, table=t)

        row[f"page{page}_us"] = round(graph_time_us(paged, 20), 1)
        if page == 16:  # the split-K count the engine picks, and more (latency of the table's indirection)
            from relax.backends.inference.embedded.model import attention_step as ast
            from relax.backends.inference.embedded.model import decode_attention as da

            base = da.splits_for(rows, Hk, L)
            for mult in (2, 4):

                def more(t=table, pk=pool_k, pv=pool_v, sp=base * mult) -> torch.Tensor:
                    args = (qk, v, cos, sin, pk, pv, idx, lengths, L, 0.125, None, None, 0.0, sp, t)
                    return ast._launch(*args)

                row[f"page16_splits{base * mult}_us"] = round(graph_time_us(more, 20), 1)
        del pool_k, pool_v
    return row


STEP_SHAPES = (  # (name, rows, query heads, kv heads, head size, hidden, columns)
    ("0.5b", 256, 14, 2, 64, 896, 384),
    ("0.5b", 256, 14, 2, 64, 896, 1152),
    ("1.5b", 256, 12, 2, 128, 1536, 384),
    ("1.5b", 256, 12, 2, 128, 1536, 1152),
    ("vl-3b", 64, 16, 2, 128, 2048, 384),
    ("vl-3b", 64, 16, 2, 128, 2048, 512),
)


def step_sweep() -> None:
    """`--step-sweep`: the attention step's settings per model shape (docstring above)."""
    from relax.backends.inference.embedded.model import attention_step as ast
    from relax.backends.inference.embedded.model import decode_attention as da

    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    for name, rows, Hq, Hk, D, hidden, L in STEP_SHAPES:
        page, C = 16, L + 128
        nb = -(-C // page)
        qk = torch.randn(rows, Hq + Hk, D, generator=g, **bf16)
        v = torch.randn(rows, Hk, D, generator=g, **bf16)
        x = torch.randn(rows, hidden, generator=g, **bf16)
        cos, sin = torch.ones(rows, D, **bf16), torch.zeros(rows, D, **bf16)
        lengths = torch.randint(L - 96, L - 31, (rows,), device="cuda", generator=g, dtype=torch.int32)
        idx = torch.arange(rows, device="cuda")
        pool_k = torch.randn(rows * nb + 1, Hk, page, D, generator=g, **bf16)
        pool_v = torch.randn_like(pool_k)
        table = (torch.randperm(rows * nb, device="cuda", generator=g) + 1).view(rows, nb).to(torch.int32)
        base = (qk, v, cos, sin, pool_k, pool_v, idx, lengths, L, D**-0.5, x, None, 1e-6)
        kv_gb = 2 * float(lengths.sum()) * Hk * D * 2 / 1e9
        results = []
        for block in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3):
                    for splits in sorted({1, 2, 3, 4, 6, 8} & set(range(1, -(-L // block) + 1))):
                        cfg = {"block": block, "warps": warps, "stages": stages, "splits": splits}
                        try:
                            us = graph_time_us(
                                lambda c=cfg, a=base, t=table: ast._launch(
                                    *a, c["splits"], t, c["block"], c["warps"], c["stages"]
                                ),
                                reps=20,
                            )
                        except Exception as e:  # noqa: BLE001 - a configuration that does not compile
                            print(json.dumps({"shape": name, **cfg, "error": str(e)[:120]}), flush=True)
                            continue
                        results.append((round(us, 2), cfg))
        results.sort(key=lambda r: r[0])
        engine_us = graph_time_us(
            lambda a=base, t=table: ast.attention_step(*a[:11], eps=1e-6, table=t), reps=20
        )
        splits = da.splits_for(rows, Hk, L)
        splits = min(2 * splits, -(-L // da.BLOCK_N)) if splits > 1 else 1
        print(json.dumps({
            "shape": name, "rows": rows, "columns": L, "heads": f"{Hq}/{Hk}x{D}",
            "floor_us": round(kv_gb / 4.8e3 * 1e6, 2), "engine_us": round(engine_us, 2),
            "engine_cfg": dict(zip(("block", "warps", "stages"), da.step_config(D), strict=True)) | {"splits": splits},
            "best": results[:5],
        }), flush=True)  # fmt: skip


def paged_sweep() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, L in ((256, 2048), (256, 8192), (16, 32768)):
        print(json.dumps(paged_case(rows, L, g)), flush=True)


def triton_split_k():
    """A [M, K] x [N, K]^T product split over K: each of `splits` programs along the third grid axis
    writes its partial sum to a float32 workspace [splits, M, N], and a second kernel adds the splits
    in a fixed order (deterministic, unlike atomics), the residual when asked, and casts. At M = 256
    the products of N = 896 or 1,152 columns have only 14-18 output tiles of 128 x 64 for 132 SMs."""
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_stages=st, num_warps=wp)
        for bm in (64, 128)
        for bn in (64, 128)
        for bk in (64, 128)
        for st in (3, 4)
        for wp in (4, 8)
    ]

    @triton.autotune(configs=configs, key=["M", "N", "K", "SPLITS"])
    @triton.jit
    def partial(
        a_ptr,
        w_ptr,
        ws_ptr,
        M,
        N,
        K,
        SPLITS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        per = tl.cdiv(tl.cdiv(K, BK), SPLITS) * BK
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(pid_k * per, tl.minimum(K, (pid_k + 1) * per), BK):
            ks = k0 + rk
            a = tl.load(
                a_ptr + rm[:, None] * K + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0
            )
            w = tl.load(
                w_ptr + rn[None, :] * K + ks[:, None], mask=(rn[None, :] < N) & (ks[:, None] < K), other=0.0
            )
            acc = tl.dot(a, w, acc)
        ptrs = ws_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def reduce(ws_ptr, c_ptr, MN, SPLITS: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < MN
        acc = tl.zeros((BLOCK,), tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(ws_ptr + s * MN + offs, mask=inside, other=0.0)
        if ACC:
            acc += tl.load(c_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=inside)

    workspaces: dict[tuple, torch.Tensor] = {}

    def run(a, w, c, accumulate: bool, splits: int) -> None:
        M, K = a.shape
        N = w.shape[0]
        key = (splits, M, N)
        if key not in workspaces:
            workspaces[key] = torch.empty(splits, M, N, device=a.device, dtype=torch.float32)
        ws = workspaces[key]
        grid = lambda meta: (triton.cdiv(M, meta["BM"]), triton.cdiv(N, meta["BN"]), splits)  # noqa: E731
        partial[grid](a, w, ws, M, N, K, SPLITS=splits)
        reduce[(triton.cdiv(M * N, 1024),)](ws, c, M * N, SPLITS=splits, ACC=accumulate, BLOCK=1024)

    return run


def split_k_sweep(M: int) -> None:
    """cuBLAS against the split-K kernel at each small product of the 0.5B and 1.5B decode step."""
    shapes = {
        "0.5B qkv": (896, 1152),
        "0.5B o": (896, 896),
        "0.5B down": (4864, 896),
        "0.5B gate_up": (896, 9728),
        "1.5B qkv": (1536, 2048),
        "1.5B o": (1536, 1536),
        "1.5B down": (8960, 1536),
        "1.5B gate_up": (1536, 17920),
    }
    tri = triton_split_k()
    torch.manual_seed(0)
    for name, (K, N) in shapes.items():
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        c = torch.zeros(M, N, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(a, w).float()
        floor = max(2 * M * N * K / 989e12, 2 * N * K / 4.8e12) * 1e6
        row = {"shape": name, "K": K, "N": N, "floor_us": round(floor, 2)}
        row["cublas_us"] = round(graph_time_us(lambda: torch.mm(a, w.t(), out=c)), 2)  # noqa: B023
        row["cublas_addmm_us"] = round(graph_time_us(lambda: c.addmm_(a, w.t())), 2)  # noqa: B023
        for splits in (1, 2, 4, 8):
            tri(a, w, c, False, splits)
            torch.cuda.synchronize()
            err = float((c.float() - ref).abs().max())
            row[f"split{splits}_us"] = round(graph_time_us(lambda: tri(a, w, c, False, splits)), 2)  # noqa: B023
            row[f"split{splits}_add_us"] = round(graph_time_us(lambda: tri(a, w, c, True, splits)), 2)  # noqa: B023
            row[f"split{splits}_err"] = round(err, 3)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--attention", action="store_true", help="sweep the decode attention's settings")
    ap.add_argument("--paged", action="store_true", help="the attention step over slots and block tables")
    ap.add_argument("--step-sweep", action="store_true", help="the attention step's settings per shape")
    ap.add_argument("--split-k", action="store_true", help="cuBLAS against a split-K Triton product")
    args = ap.parse_args()
    if args.split_k:
        split_k_sweep(args.rows)
        return
    if args.step_sweep:
        step_sweep()
        return
    if args.paged:
        paged_sweep()
        return
    if args.attention:
        attention_sweep(args.rows)
        return
    torch.manual_seed(0)
    M, dev, dt = args.rows, "cuda", torch.bfloat16
    tri = None if args.no_triton else triton_linear()
    rows = []
    for name, (K, N) in SHAPES.items():
        a = torch.randn(M, K, device=dev, dtype=dt)
        w = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
        c = torch.zeros(M, N, device=dev, dtype=dt)
        floor = max(2 * M * N * K / 989e12, 2 * N * K / 4.8e12) * 1e6
        row = {"shape": name, "K": K, "N": N, "floor_us": round(floor, 1)}
        torch.backends.cuda.preferred_blas_library("cublas")
        row["linear_us"] = round(graph_time_us(lambda: torch.mm(a, w.t(), out=c)), 1)  # noqa: B023
        row["addmm_us"] = round(graph_time_us(lambda: c.addmm_(a, w.t())), 1)  # noqa: B023
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["lt_linear_us"] = round(graph_time_us(lambda: torch.mm(a, w.t(), out=c)), 1)  # noqa: B023
        row["lt_addmm_us"] = round(graph_time_us(lambda: c.addmm_(a, w.t())), 1)  # noqa: B023
        torch.backends.cuda.preferred_blas_library("cublas")
        if tri is not None:
            ref = F.linear(a, w).float()
            tri(a, w, c, False)
            torch.cuda.synchronize()
            row["triton_err"] = round(float((c.float() - ref).abs().max()), 3)
            row["triton_us"] = round(graph_time_us(lambda: tri(a, w, c, False)), 1)  # noqa: B023
        rows.append(row)
        print(json.dumps(row), flush=True)
    total = {
        k: round(sum(r.get(k, 0) * (24 if r["shape"] != "lm_head" else 1) for r in rows), 1)
        for k in ("floor_us", "linear_us", "lt_linear_us", "triton_us")
    }
    print(json.dumps({"step_total_us (24 layers + lm_head)": total}), flush=True)


if __name__ == "__main__":
    main()
