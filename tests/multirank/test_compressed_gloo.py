"""compressed_allreduce on 2 and 4 forked gloo ranks against a reference simulated in one process.

Each rank returns its inputs, outputs and error buffers; the test replays SPEC §1 for all n
workers and servers in numpy (float64 norms, fp32 elementwise) and compares: signs must agree
exactly, magnitudes to a tight tolerance. Cross-rank results are compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commopt import NonFiniteError, compressed_allreduce, padded_size
from commopt.compressed import compression_bytes
from tests.multirank.harness import run_ranks

F32 = np.float32
CALLS = 4
TIMEOUT = 120.0


def _inputs(rank: int, call: int, length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 17 * call + length)
    # Different ranks, different buffers; a per-rank offset keeps the worker scales apart.
    return torch.randn(length, generator=gen) * (1.0 + rank) + 0.3 * rank


def _stateful_calls(backend, lengths: list[int]) -> dict:
    """Run CALLS compressed calls per length, keeping e and f between calls."""
    n = backend.world_size
    out: dict = {}
    for length in lengths:
        padded = padded_size(length, n)
        e, f = torch.zeros(padded), torch.zeros(padded // n)
        record = {"x": [], "y": [], "e": [], "f": [], "bytes": [], "calls": []}
        for call in range(CALLS):
            x = _inputs(backend.rank, call, length)
            before = backend.stats.snapshot()
            # Use the default backend (set by the harness) on one call to cover backend=None.
            y = compressed_allreduce(x, e, f, backend if call else None)
            delta = backend.stats - before
            record["x"].append(x.numpy().copy())
            record["y"].append(y.numpy().copy())
            record["e"].append(e.numpy().copy())
            record["f"].append(f.numpy().copy())
            record["bytes"].append(delta.bytes_sent)
            record["calls"].append({k: v for k, v in delta.calls_by_op.items() if v})
        out[length] = record
    return out


# -- the reference --------------------------------------------------------------------------------
def _sgn(a: np.ndarray) -> np.ndarray:
    return np.where(a >= 0, F32(1), F32(-1)).astype(F32)


def _rms(a: np.ndarray) -> F32:
    a64 = a.astype(np.float64)
    return F32(np.sqrt(np.dot(a64, a64) / a64.size))


def reference(xs: list[list[np.ndarray]], n: int, length: int):
    """SPEC §1 for n ranks at once; xs[r][k] is rank r's input to call k.

    Returns per call: y, [e_r], [f_r]."""
    padded = padded_size(length, n)
    chunk = padded // n
    e = [np.zeros(padded, dtype=F32) for _ in range(n)]
    f = [np.zeros(chunk, dtype=F32) for _ in range(n)]
    results = []
    for k in range(len(xs[0])):
        cs, scales = [], []
        for r in range(n):
            c = e[r].copy()
            c[:length] = xs[r][k] + e[r][:length]
            s = _rms(c)
            e[r] = (c - s * _sgn(c)).astype(F32)
            cs.append(c)
            scales.append(s)
        pieces = []
        for j in range(n):
            a = np.mean(
                [
                    np.float64(scales[i]) * _sgn(cs[i][j * chunk : (j + 1) * chunk])
                    for i in range(n)
                ],
                axis=0,
            ).astype(F32)
            c_s = (a + f[j]).astype(F32)
            t = _rms(c_s)
            f[j] = (c_s - t * _sgn(c_s)).astype(F32)
            pieces.append(t * _sgn(c_s))
        y = np.concatenate(pieces)[:length]
        results.append((y, [v.copy() for v in e], [v.copy() for v in f]))
    return results


LENGTHS = [1, 7, 1001, 4099]


@pytest.mark.parametrize("n", [2, 4])
def test_matches_reference_and_is_identical_on_every_rank(n):
    per_rank = run_ranks(_stateful_calls, n, LENGTHS, timeout=TIMEOUT)
    for length in LENGTHS:
        recs = [per_rank[r][length] for r in range(n)]
        ref = reference([rec["x"] for rec in recs], n, length)
        for k in range(CALLS):
            y0 = recs[0]["y"][k]
            assert y0.shape == (length,) and y0.dtype == F32
            for r in range(1, n):
                np.testing.assert_array_equal(
                    recs[r]["y"][k].view(np.uint32), y0.view(np.uint32), err_msg=f"rank {r}"
                )
            y_ref, e_ref, f_ref = ref[k]
            where = f"L={length} call={k}"
            np.testing.assert_array_equal(np.signbit(y0), np.signbit(y_ref), err_msg=where)
            np.testing.assert_allclose(y0, y_ref, rtol=2e-5, atol=0, err_msg=where)
            for r in range(n):
                scale = np.abs(e_ref[r]).max() + np.abs(recs[r]["x"][k]).max()
                np.testing.assert_allclose(
                    recs[r]["e"][k], e_ref[r], rtol=0, atol=1e-5 * scale, err_msg=f"{where} e{r}"
                )
                fscale = max(np.abs(f_ref[r]).max(), np.abs(y_ref).max())
                np.testing.assert_allclose(
                    recs[r]["f"][k], f_ref[r], rtol=0, atol=1e-5 * fscale, err_msg=f"{where} f{r}"
                )
            # The counter agrees with the SPEC §7 model: bits both ways plus the O(n) scales.
            for r in range(n):
                assert recs[r]["bytes"][k] == compression_bytes(length, n)
                assert recs[r]["calls"][k] == {"all_gather": 3, "all_to_all": 1}
            padded = padded_size(length, n)
            assert compression_bytes(length, n) == 2 * (n - 1) * padded // (8 * n) + 20 * (n - 1)


def test_average_is_unbiased_over_calls():
    """Error feedback: over repeated calls the mean output approaches the true average.

    One call alone is off by ≈27 % of the average's magnitude (a 1-bit sign per element); with
    the errors carried from call to call the gap of the running mean shrinks like ≈1.3/T, so
    after 60 calls it is ≈2 %; without error feedback it would stay at ≈27 %.
    """
    calls, length = 60, 1000

    def fn(backend):
        torch.manual_seed(backend.rank)
        target = torch.randn(length) + backend.rank  # a fixed per-rank buffer, sent repeatedly
        padded = padded_size(length, 4)
        e, f = torch.zeros(padded), torch.zeros(padded // 4)
        total = torch.zeros(length, dtype=torch.float64)
        first = None
        for _ in range(calls):
            y = compressed_allreduce(target, e, f, backend).double()
            first = y.clone() if first is None else first
            total += y
        return target.numpy(), first.numpy(), (total / calls).numpy()

    results = run_ranks(fn, 4, timeout=TIMEOUT)
    true_avg = np.mean([x for x, _, _ in results], axis=0)
    size = np.abs(true_avg).mean()
    one_shot_gap = np.abs(results[0][1] - true_avg).mean() / size
    running_gap = np.abs(results[0][2] - true_avg).mean() / size
    assert one_shot_gap > 0.15
    assert running_gap < 0.05


def _dtype_and_inplace(backend):
    n = backend.world_size
    torch.manual_seed(7 + backend.rank)
    x = torch.randn(5, 11).to(torch.bfloat16)
    e, f = torch.zeros(padded_size(55, n)), torch.zeros(padded_size(55, n) // n)
    y = compressed_allreduce(x, e, f, backend)
    z = torch.randn(33)
    e2, f2 = torch.zeros(padded_size(33, n)), torch.zeros(padded_size(33, n) // n)
    ret = compressed_allreduce(z, e2, f2, backend, out=z)
    return y.float().numpy(), str(y.dtype), tuple(y.shape), z.numpy(), ret is z


def test_bf16_and_in_place_outputs_are_identical_on_every_rank():
    results = run_ranks(_dtype_and_inplace, 2, timeout=TIMEOUT)
    for y, dtype, shape, z, same in results:
        assert dtype == "torch.bfloat16" and shape == (5, 11) and same
        np.testing.assert_array_equal(y, results[0][0])
        np.testing.assert_array_equal(z, results[0][3])
    # Every element is ±t_j of its chunk: at most 2 distinct magnitudes for n = 2.
    assert len(np.unique(np.abs(results[0][3]))) <= 2


# -- failures reach every rank --------------------------------------------------------------------
def _nonfinite_on_one_rank(backend, bad: float):
    n = backend.world_size
    length = 1001
    padded = padded_size(length, n)
    e, f = torch.zeros(padded), torch.zeros(padded // n)
    compressed_allreduce(_inputs(backend.rank, 0, length), e, f, backend)  # non-zero errors
    e_before, f_before = e.clone(), f.clone()
    x = _inputs(backend.rank, 1, length)
    if backend.rank == n - 1:
        x[500] = bad
    try:
        compressed_allreduce(x, e, f, backend)
        outcome = None
    except NonFiniteError as err:
        outcome = (err.ranks, str(err))
    unchanged = bool(torch.equal(e, e_before) and torch.equal(f, f_before))
    # The next call goes on normally from the untouched state, on every rank alike.
    y = compressed_allreduce(_inputs(backend.rank, 2, length), e, f, backend)
    return outcome, unchanged, y.numpy()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_on_one_rank_raises_everywhere_and_keeps_errors(n, bad):
    results = run_ranks(_nonfinite_on_one_rank, n, bad, timeout=TIMEOUT)
    for rank, (outcome, unchanged, y) in enumerate(results):
        assert outcome is not None, f"rank {rank} did not raise NonFiniteError"
        ranks, message = outcome
        assert ranks == [n - 1]
        assert f"rank(s) [{n - 1}]" in message and "left unchanged" in message
        assert unchanged, f"rank {rank}: e or f changed"
        np.testing.assert_array_equal(y, results[0][2])


def _overflow_from_finite_inputs(backend, case: str):
    """``scale``: ranks 0 and n−1 send x = 3e38 everywhere, so their worker scales are 3e38 and
    a server's sum of ±s overflows; ``server``: rank 0's server error holds 3.4e38, so its
    c_s = a + f and the update of f leave fp32's range. Both inputs are finite."""
    n = backend.world_size
    length = 1001
    padded = padded_size(length, n)
    e, f = torch.zeros(padded), torch.zeros(padded // n)
    compressed_allreduce(_inputs(backend.rank, 0, length), e, f, backend)  # non-zero errors
    x = _inputs(backend.rank, 1, length)
    if case == "scale" and backend.rank in (0, n - 1):
        x.fill_(3e38)
    if case == "server" and backend.rank == 0:
        f[5] = 3.4e38
    e_before, f_before = e.clone(), f.clone()
    try:
        y = compressed_allreduce(x, e, f, backend)
        return None, bool(torch.isfinite(y).all())
    except NonFiniteError as err:
        unchanged = bool(torch.equal(e, e_before) and torch.equal(f, f_before))
        return (err.ranks, err.overflow, str(err)), unchanged


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", ["scale", "server"])
def test_overflow_from_finite_inputs_raises_everywhere_and_keeps_errors(n, case):
    """Without the check, the output was inf on every rank (no error): a silent wrong result."""
    results = run_ranks(_overflow_from_finite_inputs, n, case, timeout=TIMEOUT)
    expected = sorted({0, n - 1}) if case == "scale" else [0]
    for rank, (outcome, unchanged) in enumerate(results):
        assert outcome is not None, f"rank {rank} returned (finite output: {unchanged})"
        ranks, overflow, message = outcome
        assert ranks == expected and overflow
        assert "fp32 would overflow" in message and "left unchanged" in message
        assert unchanged, f"rank {rank}: e or f changed"


def _different_lengths(backend):
    n = backend.world_size
    outcomes = []
    for length in (1001 + backend.rank, 40 * (backend.rank + 1)):
        padded = padded_size(length, n)
        e, f = torch.zeros(padded), torch.zeros(padded // n)
        try:
            compressed_allreduce(torch.randn(length), e, f, backend)
            outcomes.append(None)
        except ValueError as err:
            outcomes.append(str(err))
        outcomes.append(bool((e == 0).all() and (f == 0).all()))
    return outcomes


@pytest.mark.parametrize("n", [2, 4])
def test_different_lengths_raise_value_error_on_every_rank(n):
    results = run_ranks(_different_lengths, n, timeout=TIMEOUT)
    lengths_a = [1001 + r for r in range(n)]
    lengths_b = [40 * (r + 1) for r in range(n)]
    for msg_a, clean_a, msg_b, clean_b in results:
        assert msg_a is not None and msg_b is not None
        assert "every rank must pass the same number of elements" in msg_a
        assert str(lengths_a) in msg_a and str(lengths_b) in msg_b
        assert clean_a and clean_b
