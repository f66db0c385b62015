"""HierarchicalExchange on 4 forked gloo ranks faking 2 nodes × 2 ranks (and 4 × 1, 1 × 4).

The reference is the hierarchical algorithm restated inside this file in numpy for all ranks
at once (node means, norms and server averages in float64, the persistent errors stored in fp32
as the ranks store them), over several stateful calls: signs must agree exactly, magnitudes and
error buffers to a tight tolerance; outputs must be bit-identical on every rank. With one node,
or one rank per node, the exchange must equal FlatExchange bit for bit.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from commopt import NonFiniteError, padded_size
from commopt.comm.shm_backend import SharedMemoryBackend
from commopt.compressed import compressed_allreduce_and_scale, compression_bytes
from commopt.exchange import FlatExchange, HierarchicalExchange, build_exchange
from commopt.exchange.topology import discover_topology
from commopt.kernels import get_kernels
from tests.multirank.harness import RankError, run_ranks

F32 = np.float32
CALLS = 4
TIMEOUT = 120.0
LENGTHS = [1, 7, 1001, 4096, 4099]


def torchrun_env(rank: int, local_size: int) -> dict[str, str]:
    return {
        "LOCAL_RANK": str(rank % local_size),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(rank // local_size),
    }


def _inputs(rank: int, call: int, length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 17 * call + length)
    return torch.randn(length, generator=gen) * (1.0 + rank) + 0.3 * rank


def _exchange(backend, placement: str, local_size: int = 2, kind: str = "hierarchical"):
    """2 × 2 as contiguous blocks (launcher env) or round-robin (hostnames a, b, a, b)."""
    if placement == "blocks":
        return build_exchange(backend, kind, env=torchrun_env(backend.rank, local_size))
    return build_exchange(backend, kind, env={}, hostname="ab"[backend.rank % 2])


def _stateful_calls(backend, placement: str) -> dict:
    ex = _exchange(backend, placement)
    assert isinstance(ex, HierarchicalExchange)
    out: dict = {"topology": ex.topology}
    for length in LENGTHS:
        state = {k: torch.zeros(v) for k, v in ex.state_numels(length).items()}
        rec: dict = {"x": [], "y": [], "e": [], "f": [], "s": [], "cross": [], "local": []}
        for call in range(CALLS):
            x = _inputs(backend.rank, call, length)
            rec["x"].append(x.numpy().copy())
            cross0, local0 = ex.cross_backend.stats.snapshot(), ex.local_backend.stats.snapshot()
            s = ex.allreduce_(x, state)
            rec["cross"].append((ex.cross_backend.stats - cross0).bytes_sent)
            rec["local"].append((ex.local_backend.stats - local0).bytes_sent)
            rec["y"].append(x.numpy().copy())
            rec["e"].append(state["worker_error"].numpy().copy())
            rec["f"].append(state["server_error"].numpy().copy())
            rec["s"].append(float(s))
        out[length] = rec
    return out


# -- the reference --------------------------------------------------------------------------------
def _sgn(a: np.ndarray) -> np.ndarray:
    return np.where(a >= 0, 1.0, -1.0)


def _rms(a: np.ndarray) -> float:
    a = a.astype(np.float64)
    return float(F32(np.sqrt(np.dot(a, a) / a.size)))


def reference(xs: list[list[np.ndarray]], nodes, length: int):
    """The hierarchical exchange for every rank at once; xs[r][k] = rank r's input to call k.

    Returns per call: (y, {rank: e}, {rank: f}, {rank: s})."""
    K, L = len(nodes), len(nodes[0])
    n = K * L
    padded = padded_size(length, n)
    S, M = padded // L, padded // (L * K)  # slice, cross-level server chunk
    e = {r: np.zeros(S, dtype=F32) for node in nodes for r in node}
    f = {r: np.zeros(M, dtype=F32) for node in nodes for r in node}
    results = []
    for k in range(len(xs[0])):
        padded_x = {}
        for r in e:
            padded_x[r] = np.zeros(padded, dtype=np.float64)
            padded_x[r][:length] = xs[r][k]
        y = np.zeros(padded)
        scales = {}
        for j in range(L):  # slice j, owned by local rank j of every node
            owners = [node[j] for node in nodes]
            # 1. node means of slice j (fp32, as sent on)
            z = {
                node[j]: F32(np.mean([padded_x[r][j * S : (j + 1) * S] for r in node], axis=0))
                for node in nodes
            }
            # 2. SPEC §1 over the K owners
            signs = {}
            for r in owners:
                c = z[r].astype(np.float64) + e[r]
                s = _rms(c)
                scales[r] = s
                signs[r] = _sgn(c)
                e[r] = (c - s * signs[r]).astype(F32)
            for q, r in enumerate(owners):  # server q of the cross group: chunk q of slice j
                chunk = slice(q * M, (q + 1) * M)
                a = np.mean([scales[i] * signs[i][chunk] for i in owners], axis=0)
                c_s = a.astype(F32).astype(np.float64) + f[r]
                t = _rms(c_s)
                f[r] = (c_s - t * _sgn(c_s)).astype(F32)
                # 3. everyone unpacks t·sgn
                y[j * S + q * M : j * S + (q + 1) * M] = t * _sgn(c_s)
        results.append((y[:length].astype(F32), dict(e), dict(f), scales))
        e = {r: v.copy() for r, v in e.items()}
        f = {r: v.copy() for r, v in f.items()}
    return results


@pytest.mark.parametrize("placement", ["blocks", "round-robin"])
def test_matches_reference_and_is_identical_on_every_rank(placement: str) -> None:
    per_rank = run_ranks(_stateful_calls, 4, placement, timeout=TIMEOUT)
    nodes = per_rank[0]["topology"].nodes
    assert nodes == (((0, 1), (2, 3)) if placement == "blocks" else ((0, 2), (1, 3)))
    for length in LENGTHS:
        recs = [per_rank[r][length] for r in range(4)]
        ref = reference([rec["x"] for rec in recs], nodes, length)
        padded = padded_size(length, 4)
        for k in range(CALLS):
            where = f"L={length} call={k}"
            y0 = recs[0]["y"][k]
            for r in range(1, 4):
                np.testing.assert_array_equal(
                    recs[r]["y"][k].view(np.uint32), y0.view(np.uint32), err_msg=f"{where} r{r}"
                )
            y_ref, e_ref, f_ref, s_ref = ref[k]
            np.testing.assert_array_equal(np.signbit(y0), np.signbit(y_ref), err_msg=where)
            np.testing.assert_allclose(y0, y_ref, rtol=2e-5, atol=0, err_msg=where)
            for r in range(4):
                scale = np.abs(e_ref[r]).max() + np.abs(recs[r]["x"][k]).max()
                np.testing.assert_allclose(
                    recs[r]["e"][k], e_ref[r], rtol=0, atol=1e-5 * scale, err_msg=f"{where} e{r}"
                )
                fscale = max(np.abs(f_ref[r]).max(), np.abs(y_ref).max())
                np.testing.assert_allclose(
                    recs[r]["f"][k], f_ref[r], rtol=0, atol=1e-5 * fscale, err_msg=f"{where} f{r}"
                )
                assert recs[r]["s"][k] == pytest.approx(s_ref[r], rel=1e-5)
                # Bytes per level: the cross level is SPEC §1 on the slice in three collectives
                # ((s, the node's two (finite, numel, safe) records) as 7 fp64, the sign
                # all-to-all, server signs + scale as one byte buffer), the local level an fp32
                # all-to-all of (L−1)/L of the buffer, the gather of the 1-bit result, the
                # 16-byte records and the 8-byte safe? flag.
                S = padded // 2
                assert recs[r]["cross"][k] == compression_bytes(S, 2) - 20 + 4 + 56
                assert recs[r]["local"][k] == 4 * padded // 2 + (S // 8 + 4 * 2) + 16 + 8


# -- the same bits as the exchange composed of its public parts ---------------------------------
def _composed(ex: HierarchicalExchange, x: torch.Tensor, state: dict) -> torch.Tensor:
    """The hierarchical exchange as first written, from public parts: an fp32 all-to-all inside
    the node and the mean in local-rank order, ``compressed_allreduce_and_scale`` across (four
    collectives), signs re-packed from the sign of y (t·sgn ≥ 0), scales |y| of each chunk,
    all-gathered inside the node and unpacked."""
    L, K = ex.local_size, ex.num_nodes
    padded = padded_size(x.numel(), L * K)
    S = padded // L
    xp = torch.zeros(padded)
    xp[: x.numel()] = x
    recv = torch.empty(L, S)
    ex.local_backend.all_to_all(recv, xp.view(L, S))
    z = recv[0].clone()
    for i in range(1, L):
        z.add_(recv[i])
    z.div_(L)
    y, _ = compressed_allreduce_and_scale(
        z, state["worker_error"], state["server_error"], ex.cross_backend, out=z
    )
    row = torch.empty(S // 8 + 4 * K, dtype=torch.uint8)
    row[: S // 8] = torch.from_numpy(np.packbits(y.numpy() >= 0))
    row[S // 8 :] = y.view(K, S // K)[:, 0].abs().view(torch.uint8)
    gathered = torch.empty(L, S // 8 + 4 * K, dtype=torch.uint8)
    ex.local_backend.all_gather(gathered, row)
    bits = gathered[:, : S // 8].contiguous().view(L * K, S // (8 * K))
    scales = gathered[:, S // 8 :].contiguous().view(torch.float32).view(L * K)
    out = torch.empty_like(x)
    get_kernels("cpu").unpack_scaled_(bits, scales, out)
    return out


def _against_composed(backend, shared_memory: bool):
    env = torchrun_env(backend.rank, 2)
    ex = build_exchange(backend, "hierarchical", env=env, shared_memory=shared_memory)
    assert isinstance(ex.local_backend, SharedMemoryBackend) == shared_memory
    mismatches = []
    for length in LENGTHS:
        fused = {k: torch.zeros(v) for k, v in ex.state_numels(length).items()}
        composed = {k: v.clone() for k, v in fused.items()}
        for call in range(CALLS + 1):
            # the first call's input is zero on every rank, the errors too: s = t = 0
            x = _inputs(backend.rank, call, length) * (call > 0)
            y_fused = x.clone()
            ex.allreduce_(y_fused, fused)
            y_composed = _composed(ex, x.clone(), composed)
            for what, a, b in (
                ("y", y_fused, y_composed),
                *((k, fused[k], composed[k]) for k in fused),
            ):
                if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                    mismatches.append(f"{what} L={length} call={call}")
    return mismatches


@pytest.mark.parametrize("shared_memory", [False, True])
def test_bit_identical_to_the_composed_exchange(shared_memory: bool) -> None:
    """Fusing the agreement into the cross scales' all-gather, the server scale into the server
    signs' all-gather, forwarding the received bits instead of re-packing y, and the shared-
    memory reduce-scatter change no bit of y, e or f (nor the +0 of a zero chunk)."""
    for mismatches in run_ranks(_against_composed, 4, shared_memory, timeout=TIMEOUT):
        assert mismatches == []


# -- in stages: the same bits, the same bytes ----------------------------------------------------
# Long enough for several 4096-element stages per cross server chunk (S/K = padded/4): 3 stages
# with a short last one and the zero pad; 4 whole ones.
STAGED_LENGTHS = [3 * 4 * 4096 - 13, 4 * 4 * 4096]


def _call_counting_bytes(ex: HierarchicalExchange, x: torch.Tensor, state: dict) -> list[int]:
    """``ex.allreduce_(x, state)``; the bytes this rank sent on the cross and the local level."""
    levels = (ex.cross_backend, ex.local_backend)
    before = [b.stats.snapshot() for b in levels]
    ex.allreduce_(x, state)
    return [(b.stats - s).bytes_sent for b, s in zip(levels, before, strict=True)]


def _staged_against_one_stage(backend, shared_memory: bool, stages: int):
    env = torchrun_env(backend.rank, 2)
    exchanges = [
        build_exchange(backend, "hierarchical", env=env, shared_memory=shared_memory, pipeline=p)
        for p in (stages, 1)
    ]
    mismatches, sent = [], []
    for length in STAGED_LENGTHS:
        staged = {k: torch.zeros(v) for k, v in exchanges[0].state_numels(length).items()}
        single = {k: v.clone() for k, v in staged.items()}
        for call in range(CALLS + 1):
            x = _inputs(backend.rank, call, length) * (call > 0)  # call 0: s = t = 0
            y_staged, y_single = x.clone(), x.clone()
            sent.append(
                (
                    _call_counting_bytes(exchanges[0], y_staged, staged),
                    _call_counting_bytes(exchanges[1], y_single, single),
                )
            )
            for what, a, b in (
                ("y", y_staged, y_single),
                *((k, staged[k], single[k]) for k in staged),
            ):
                if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                    mismatches.append(f"{what} L={length} call={call}")
    return mismatches, sent, set(exchanges[0].phase_seconds)


@pytest.mark.parametrize(("shared_memory", "stages"), [(False, 3), (True, 3), (True, 4)])
def test_in_stages_bit_identical_to_one_stage(shared_memory: bool, stages: int) -> None:
    """``pipeline=k`` (the cross level in k stages, each gathered inside the node and unpacked
    as it arrives) gives the bits of one stage in y, e and f, and sends the same bytes on each
    level."""
    for mismatches, sent, phases in run_ranks(
        _staged_against_one_stage, 4, shared_memory, stages, timeout=TIMEOUT
    ):
        assert mismatches == []
        assert phases == {"local_reduce", "cross", "local_gather"}
        for staged, single in sent:
            assert staged == single


def test_error_feedback_makes_the_running_mean_unbiased() -> None:
    """Over repeated calls on fixed inputs the running mean approaches the true average.

    One call alone is off by tens of percent (one sign per element); with both levels' errors
    carried between calls the running mean's gap shrinks roughly like 1/T."""
    calls, length = 60, 1000

    def fn(backend):
        ex = _exchange(backend, "blocks")
        state = {k: torch.zeros(v) for k, v in ex.state_numels(length).items()}
        target = _inputs(backend.rank, 0, length)
        total = torch.zeros(length, dtype=torch.float64)
        first = None
        for _ in range(calls):
            y = target.clone()
            ex.allreduce_(y, state)
            first = y.double() if first is None else first
            total += y.double()
        return target.numpy(), first.numpy(), (total / calls).numpy()

    results = run_ranks(fn, 4, timeout=TIMEOUT)
    true_avg = np.mean([x for x, _, _ in results], axis=0)
    size = np.abs(true_avg).mean()
    one_shot_gap = np.abs(results[0][1] - true_avg).mean() / size
    running_gap = np.abs(results[0][2] - true_avg).mean() / size
    assert one_shot_gap > 0.3
    assert running_gap < one_shot_gap / 10


# -- one level only: exactly flat -----------------------------------------------------------------
def _against_flat(backend, local_size: int):
    env = torchrun_env(backend.rank, local_size)
    hier = build_exchange(backend, "hierarchical", env=env)
    auto = build_exchange(backend, "auto", env=env)
    flat = FlatExchange(backend)
    assert hier.state_numels(1001) == flat.state_numels(1001)
    assert hier.name == "flat"  # its checkpoints are flat ones
    outs = []
    for ex in (hier, flat):
        state = {k: torch.zeros(v) for k, v in ex.state_numels(1001).items()}
        ys, ss = [], []
        for call in range(CALLS):
            x = _inputs(backend.rank, call, 1001)
            ss.append(ex.allreduce_(x, state))
            ys.append(x)
        outs.append((ys, ss, state))
    return outs, type(auto).__name__


@pytest.mark.parametrize("local_size", [1, 4])
def test_one_level_is_exactly_flat(local_size: int) -> None:
    for (hier, flat), auto in run_ranks(_against_flat, 4, local_size, timeout=TIMEOUT):
        assert auto == "FlatExchange"
        for a, b in zip(hier[0], flat[0], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(hier[1], flat[1], strict=True):
            assert torch.equal(a, b)
        for key in ("worker_error", "server_error"):
            assert torch.equal(hier[2][key], flat[2][key])


# -- state sizes ----------------------------------------------------------------------------------
def _numels(backend):
    ex = _exchange(backend, "blocks")
    auto = build_exchange(backend, "auto", env=torchrun_env(backend.rank, 2))
    numels = {numel: ex.state_numels(numel) for numel in (1, 1000, 4096, 16 * 2**20)}
    return numels, type(auto).__name__, ex.name


def test_worker_error_shrinks_by_local_size() -> None:
    results = run_ranks(_numels, 4, timeout=TIMEOUT)
    numels, auto = results[0][:2]
    assert auto == "HierarchicalExchange"
    assert [r[2] for r in results] == [f"hierarchical:2x2:{i}.{j}" for i in (0, 1) for j in (0, 1)]
    for numel, sizes in numels.items():
        padded = padded_size(numel, 4)  # a multiple of 8·K·L: slices are whole server bytes
        assert sizes == {"worker_error": padded // 2, "server_error": padded // 4}
        flat = {"worker_error": padded, "server_error": padded // 4}
        assert sizes["worker_error"] * 2 == flat["worker_error"]
        assert sizes["server_error"] == flat["server_error"]


# -- errors ---------------------------------------------------------------------------------------
def _nonfinite_on_one_rank(backend):
    ex = _exchange(backend, "blocks")
    state = {k: torch.zeros(v) for k, v in ex.state_numels(1001).items()}
    ex.allreduce_(_inputs(backend.rank, 0, 1001), state)  # non-zero errors
    before = {k: v.clone() for k, v in state.items()}
    x = _inputs(backend.rank, 1, 1001)
    x_before = x.clone()
    if backend.rank == 2:
        x[700] = float("nan")
    try:
        ex.allreduce_(x, state)
    except NonFiniteError as err:
        untouched = all(torch.equal(state[k], before[k]) for k in state)
        same_x = torch.equal(x, x_before) if backend.rank != 2 else True
        # The exchange still works afterwards (no rank was left inside a collective).
        y = _inputs(backend.rank, 2, 1001)
        ex.allreduce_(y, state)
        return err.ranks, untouched, same_x, y
    return None


def test_non_finite_input_raises_on_every_rank_and_leaves_state() -> None:
    results = run_ranks(_nonfinite_on_one_rank, 4, timeout=TIMEOUT)
    for res in results:
        assert res is not None
        ranks, untouched, same_x, y = res
        assert ranks == [2] and untouched and same_x
        assert torch.equal(y, results[0][3])


def _unequal_lengths(backend):
    ex = _exchange(backend, "blocks")
    length = 1001 if backend.rank != 1 else 1000
    state = {k: torch.zeros(v) for k, v in ex.state_numels(length).items()}
    ex.allreduce_(_inputs(backend.rank, 0, length), state)


def test_unequal_lengths_raise_on_every_rank() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_unequal_lengths, 4, timeout=TIMEOUT)
    assert all(
        m and "same number of elements, got [1001, 1000, 1001, 1001]" in m
        for m in info.value.messages
    )


def _unequal_nodes(backend):
    hostname = "aaab"[backend.rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = build_exchange(backend, "auto", env={}, hostname=hostname)
    try:
        build_exchange(backend, "hierarchical", env={}, hostname=hostname)
    except ValueError as err:
        return type(auto).__name__, [str(w.message) for w in caught], str(err)
    return None


def test_unequal_nodes_refused_by_hierarchical_and_flat_with_one_warning_by_auto() -> None:
    for res in run_ranks(_unequal_nodes, 4, timeout=TIMEOUT):
        assert res is not None
        auto, warned, error = res
        assert auto == "FlatExchange"
        assert len(warned) == 1 and "unequal numbers of ranks [3, 1]" in warned[0]
        assert "same number of ranks on every node, got node sizes [3, 1]" in error


def _bad_inputs(backend):
    errors = []
    env = torchrun_env(backend.rank, 2)
    topo = discover_topology(backend, env)
    try:
        build_exchange(backend, "ring")
    except ValueError as err:
        errors.append(str(err))
    try:
        build_exchange(backend, "flat", env=env)
    except ValueError as err:
        errors.append(str(err))
    try:
        HierarchicalExchange(backend, "2x2")  # type: ignore[arg-type]
    except TypeError as err:
        errors.append(str(err))
    wrong = type(topo)(0, 0, 0, 2, 1, ((0, 1),), "torchrun")  # a topology of another job
    try:
        HierarchicalExchange(backend, wrong)
    except ValueError as err:
        errors.append(str(err))
    # Level backends swapped: the local group where the cross group belongs (collective check).
    good = HierarchicalExchange(backend, topo)
    try:
        HierarchicalExchange(
            backend, topo, local_backend=good.cross_backend, cross_backend=good.local_backend
        )
    except ValueError as err:
        errors.append(str(err))
    return errors


def test_wrong_topology_inputs() -> None:
    for rank, errors in enumerate(run_ranks(_bad_inputs, 4, timeout=TIMEOUT)):
        assert len(errors) == 5, errors
        assert (
            "Invalid topology: 'ring' (choose one of 'flat', 'hierarchical', 'auto')" in errors[0]
        )
        assert "topology='flat' takes no further arguments, got ['env']" in errors[1]
        assert "topology must be a commopt.exchange.topology.Topology" in errors[2]
        assert "the topology describes rank 0 of 2 but the backend is rank" in errors[3]
        assert "level backends do not match the topology on rank(s) [1, 2]" in errors[4]
        if rank in (1, 2):
            here = {
                1: "rank 0 of 2, cross_backend rank 1 of 2",
                2: "rank 1 of 2, cross_backend rank 0 of 2",
            }
            assert f"local_backend is {here[rank]}; expected" in errors[4]


# -- overflow from finite inputs: one cross group's scale, or one server's c_s -------------------
OVERFLOW_TIMEOUT = 40.0  # a rank left waiting in a collective would sit there far longer


def _overflow_in_one_cross_group(backend, case: str):
    """Rank r = (node r // 2, local rank r % 2); 1001 elements, S = 512, M = 256. ``z``: node 0
    puts 3e38 at element 700 (slice 1) on both ranks, its node mean overflows; ``e``: rank 3's
    worker error 3e38 meets a node mean of 1e38 in slice 1; ``f``: rank 0's server error holds
    3.4e38 and every worker scale is 1e33, so c_s = a + f overflows in fp32."""
    ex = _exchange(backend, "blocks")
    state = {k: torch.zeros(v) for k, v in ex.state_numels(1001).items()}
    ex.allreduce_(_inputs(backend.rank, 0, 1001), state)  # non-zero errors
    sane = {k: v.clone() for k, v in state.items()}
    x = _inputs(backend.rank, 1, 1001)
    if case == "z" and backend.rank in (0, 1):
        x[700] = 3e38
    if case == "e" and backend.rank in (2, 3):
        x[522] = 1e38
    if case == "e" and backend.rank == 3:
        state["worker_error"][10] = 3e38
    if case == "f":
        x.fill_(1e33)
        if backend.rank == 0:
            state["server_error"][5] = 3.4e38
    before = {k: v.clone() for k, v in state.items()}
    try:
        ex.allreduce_(x, state)
        return None
    except NonFiniteError as err:
        ranks = err.ranks if err.overflow else None
    untouched = all(torch.equal(state[k], before[k]) for k in state)
    # The next call, from the state before the bad values, is the call a fresh state gives.
    state = {k: v.clone() for k, v in sane.items()}
    again = {k: v.clone() for k, v in sane.items()}
    y, y_again = _inputs(backend.rank, 2, 1001), _inputs(backend.rank, 2, 1001)
    ex.allreduce_(y, state)
    ex.allreduce_(y_again, again)
    same = torch.equal(y, y_again) and all(torch.equal(state[k], again[k]) for k in state)
    return ranks, untouched, same, y


@pytest.mark.parametrize(("case", "bad_rank"), [("z", 1), ("e", 3), ("f", 0)])
def test_overflow_from_finite_inputs_raises_on_every_rank_and_leaves_state(
    case: str, bad_rank: int
) -> None:
    results = run_ranks(_overflow_in_one_cross_group, 4, case, timeout=OVERFLOW_TIMEOUT)
    for res in results:
        assert res is not None, f"{case}: a rank returned without NonFiniteError"
        ranks, untouched, same, y = res
        assert ranks == [bad_rank] and untouched and same
        assert bool(torch.isfinite(y).all()) and torch.equal(y, results[0][3])
