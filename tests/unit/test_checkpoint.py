"""Checkpoints in one process: bit-exact resume, atomic replacement, and every refusal."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import commopt
from commopt.checkpoint import MANIFEST_NAME, SHARED_NAME, CheckpointError, shard_name
from tests.optim_registry import BY_NAME, OPTIMIZERS, reload, state_dict_diff

#: the optimizer of the tests of the checkpoint files themselves (layout, atomic replacement,
#: refusals), which do not depend on the algorithm; the resume tests run every optimizer
VEHICLE = BY_NAME["OnebitAdam"]


def _opt(model: torch.nn.Module, **overrides) -> torch.optim.Optimizer:
    return VEHICLE.make(model.parameters(), **overrides)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for t in steps:
        x, y = _batch(t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


RESUMES = [(info, stop) for info in OPTIMIZERS for stop in info.resume_points()]


@pytest.mark.parametrize(("info", "stop"), RESUMES, ids=[f"{i}-{s}" for i, s in RESUMES])
def test_resume_is_bit_exact(tmp_path, info, stop):
    # Saved just before and just after each phase starts (OptimizerInfo.resume_points).
    model = _model()
    opt = info.make(model.parameters())
    _train(model, opt, range(stop))
    commopt.save_checkpoint(tmp_path / "ck", model, opt, step=stop, note="hello")
    _train(model, opt, range(stop, info.steps))
    expected = _params(model)

    fresh = _model(seed=1)  # different initial values: everything must come from the checkpoint
    opt2 = info.make(fresh.parameters())
    extra = commopt.load_checkpoint(tmp_path / "ck", fresh, opt2)
    assert extra == {"step": stop, "note": "hello"}
    assert opt2.global_state["step"] == stop
    _train(fresh, opt2, range(extra["step"], info.steps))
    for a, b in zip(expected, _params(fresh), strict=True):
        assert torch.equal(a, b)
    assert state_dict_diff(opt.state_dict(), opt2.state_dict()) == []


def test_layout(tmp_path):
    model = _model()
    opt = _opt(model, freeze_step=2)
    _train(model, opt, range(3))
    commopt.save_checkpoint(tmp_path / "ck", model, opt)
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == sorted([MANIFEST_NAME, SHARED_NAME, shard_name(0, 1)])
    manifest = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text())
    assert manifest["optimizer"] == "commopt.optim.onebit_adam.OnebitAdam"
    assert manifest["world_size"] == 1
    assert manifest["step"] == 3
    assert manifest["commopt_version"] == commopt.__version__
    assert manifest["param_shapes"] == [[[4, 5], [4], [2, 4], [2]]]
    for name in (SHARED_NAME, shard_name(0, 1)):
        assert manifest["files"][name]["bytes"] == os.path.getsize(tmp_path / "ck" / name)
    assert not os.path.exists(tmp_path / "ck.tmp")


def test_a_path_with_a_trailing_slash_saves_and_loads(tmp_path):
    # issue 41: "ckpt/" staged into "ckpt/.tmp", inside the directory it then replaced
    model = _model()
    opt = _opt(model, freeze_step=2)
    _train(model, opt, range(3))
    for _ in range(2):  # the second save replaces the first
        commopt.save_checkpoint(f"{tmp_path / 'ck'}{os.sep}", model, opt, step=3)
    opt2 = _opt(_model(), freeze_step=2)
    assert commopt.load_checkpoint(f"{tmp_path / 'ck'}{os.sep}", None, opt2) == {"step": 3}
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_overwrite_replaces_the_old_checkpoint(tmp_path):
    model = _model()
    opt = _opt(model, freeze_step=2)
    _train(model, opt, range(2))
    commopt.save_checkpoint(tmp_path / "ck", model, opt, step=2)
    _train(model, opt, range(2, 4))
    commopt.save_checkpoint(tmp_path / "ck", model, opt, step=4)
    opt2 = _opt(_model(), freeze_step=2)
    assert commopt.load_checkpoint(tmp_path / "ck", None, opt2) == {"step": 4}
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import commopt.checkpoint as ck

    model = _model()
    opt = _opt(model, freeze_step=2)
    _train(model, opt, range(3))
    commopt.save_checkpoint(tmp_path / "ck", model, opt, step=3)
    saved = _params(model)
    _train(model, opt, range(3, 5))

    real = ck._write_atomic
    calls = []

    def crash_on_second_file(obj, directory, name):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return real(obj, directory, name)

    monkeypatch.setattr(ck, "_write_atomic", crash_on_second_file)
    with pytest.raises(
        CheckpointError, match=r"writing the shards failed on rank\(s\) \[0\].*No space"
    ):
        commopt.save_checkpoint(tmp_path / "ck", model, opt, step=5)
    monkeypatch.setattr(ck, "_write_atomic", real)

    # The half-written staging directory has no manifest and is refused; the old one loads.
    with pytest.raises(CheckpointError, match=r"has no MANIFEST\.json"):
        commopt.load_checkpoint(tmp_path / "ck.tmp", None, opt)
    fresh = _model(seed=3)
    opt2 = _opt(fresh, freeze_step=2)
    assert commopt.load_checkpoint(tmp_path / "ck", fresh, opt2) == {"step": 3}
    for a, b in zip(saved, _params(fresh), strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def saved(tmp_path):
    model = _model()
    opt = _opt(model, freeze_step=2)
    _train(model, opt, range(3))
    commopt.save_checkpoint(tmp_path / "ck", model, opt)
    return tmp_path / "ck"


def _unchanged_after_refusal(path, model, opt, match):
    """load_checkpoint raises CheckpointError matching ``match``; the model's and the
    optimizer's state dicts are bit for bit what they were."""
    model_before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = reload(opt.state_dict())
    with pytest.raises(CheckpointError, match=match):
        commopt.load_checkpoint(path, model, opt)
    for key, value in model.state_dict().items():
        assert torch.equal(value, model_before[key]), key
    assert state_dict_diff(opt_before, opt.state_dict()) == []


def test_refuses_another_optimizer_type(saved):
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    _unchanged_after_refusal(
        saved,
        model,
        opt,
        r"saved by a commopt\.optim\.onebit_adam\.OnebitAdam optimizer and "
        r"cannot be loaded into a torch\.optim\.adam\.Adam.*build a OnebitAdam",
    )


def test_refuses_truncated_shard(saved):
    shard = saved / shard_name(0, 1)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    model = _model()
    opt = _opt(model, freeze_step=2)
    _unchanged_after_refusal(
        saved,
        model,
        opt,
        rf"rank-00000-of-00001\.pt .* is truncated: {len(data) // 2} bytes, "
        rf"the manifest says {len(data)}",
    )


def test_refuses_corrupt_shared_file(saved):
    shared = saved / SHARED_NAME
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    model = _model()
    opt = _opt(model, freeze_step=2)
    _unchanged_after_refusal(saved, model, opt, r"shared\.pt .* is corrupt: its SHA-256")


def test_refuses_missing_manifest(saved):
    os.remove(saved / MANIFEST_NAME)
    model = _model()
    opt = _opt(model, freeze_step=2)
    _unchanged_after_refusal(saved, model, opt, r"has no MANIFEST\.json: it is not a complete")


def test_refuses_missing_directory(tmp_path):
    opt = _opt(_model())
    with pytest.raises(CheckpointError, match="no checkpoint directory at"):
        commopt.load_checkpoint(tmp_path / "nothing", None, opt)


def test_refuses_mismatched_parameter_shapes(saved):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    opt = _opt(model, freeze_step=2)
    _unchanged_after_refusal(
        saved,
        model,
        opt,
        r"param_groups\[0\]\['params'\]\[2\] has shape \(2, 4\) in the "
        r"checkpoint .* but \(3, 4\) here",
    )


def test_refuses_mismatched_model(saved):
    # Same optimizer parameters, but the model given has an extra buffer.
    model = _model()
    model.register_buffer("extra", torch.zeros(3))
    opt = _opt(model, freeze_step=2)
    _unchanged_after_refusal(
        saved, model, opt, r"model state keys do not match.*missing \['extra'\]"
    )


def test_refuses_newer_format(saved):
    manifest = json.loads((saved / MANIFEST_NAME).read_text())
    manifest["format_version"] = 99
    (saved / MANIFEST_NAME).write_text(json.dumps(manifest))
    opt = _opt(_model(), freeze_step=2)
    with pytest.raises(CheckpointError, match="format version 99, newer than"):
        commopt.load_checkpoint(saved, None, opt)


def test_plain_torch_optimizer_round_trip(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(3))
    commopt.save_checkpoint(tmp_path / "ck", model, opt)
    _train(model, opt, range(3, 6))
    expected = _params(model)
    fresh = _model(seed=5)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    commopt.load_checkpoint(tmp_path / "ck", fresh, opt2)
    _train(fresh, opt2, range(3, 6))
    for a, b in zip(expected, _params(fresh), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_bf16_resume_keeps_the_fp32_master_weights(tmp_path, info):
    model = _model().to(torch.bfloat16)
    opt = info.make(model.parameters())

    def train(m, o, steps):
        for t in steps:
            x, y = _batch(t)
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x.bfloat16()).float(), y).backward()
            o.step()

    stop = info.phases()[-1].first  # inside the last phase
    train(model, opt, range(stop))
    commopt.save_checkpoint(tmp_path / "ck", model, opt)
    train(model, opt, range(stop, info.steps))
    fresh = _model(seed=2).to(torch.bfloat16)
    opt2 = info.make(fresh.parameters())
    commopt.load_checkpoint(tmp_path / "ck", fresh, opt2)
    assert all(opt2.state[p]["master"].dtype == torch.float32 for p in fresh.parameters())
    train(fresh, opt2, range(stop, info.steps))
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master"], opt2.state[q]["master"])


# -- extra values the safe loader refuses (issue #15.5) ------------------------------------------
@pytest.mark.parametrize(
    ("extra", "where", "kind"),
    [
        ({"rng": np.random.get_state()}, r"extra\['rng'\]\[1\]", "numpy.ndarray"),
        ({"loss": np.float64(0.5)}, r"extra\['loss'\]", "numpy.float64"),
        ({"data": {"epoch": 3, "order": np.arange(4)}}, r"extra\['data'\]\['order'\]", "ndarray"),
        ({"seen": [1, frozenset({2})]}, r"extra\['seen'\]\[1\]", "frozenset"),
        ({"fn": slice(2)}, r"extra\['fn'\]", "slice"),
    ],
    ids=["np.random.get_state", "numpy-scalar", "nested-array", "frozenset", "slice"],
)
def test_unloadable_extra_is_refused_and_the_previous_checkpoint_kept(tmp_path, extra, where, kind):
    model = _model()
    opt = _opt(model)
    _train(model, opt, range(2))
    commopt.save_checkpoint(tmp_path / "ck", model, opt, step=2)
    before = {f: (tmp_path / "ck" / f).read_bytes() for f in os.listdir(tmp_path / "ck")}
    _train(model, opt, range(2, 4))

    with pytest.raises(CheckpointError, match=rf"{where}.*{kind}.*weights_only"):
        commopt.save_checkpoint(tmp_path / "ck", model, opt, step=4, **extra)

    after = {f: (tmp_path / "ck" / f).read_bytes() for f in os.listdir(tmp_path / "ck")}
    assert after == before  # the good checkpoint was not touched
    fresh = _model(seed=1)
    opt2 = _opt(fresh)
    assert commopt.load_checkpoint(tmp_path / "ck", fresh, opt2) == {"step": 2}


def test_every_value_the_safe_loader_accepts_round_trips(tmp_path):
    # What save accepts is exactly what torch.load(weights_only=True) accepts: these all load.
    extra = {
        "step": 7,
        "lr": 1e-3,
        "name": "run-1",
        "flags": (True, None, 1 + 2j, b"raw"),
        "torch_rng": torch.get_rng_state(),
        "np_rng": np.random.default_rng(0).bit_generator.state,  # a plain dict: accepted
        "legacy_np_rng": [np.random.get_state()[1].tolist()],  # converted by the user: accepted
        "nested": {"a": [torch.ones(2), {"b": torch.float16, "c": torch.Size([3])}]},
        "ids": {1, 2},
    }
    model = _model()
    opt = _opt(model)
    _train(model, opt, range(2))
    commopt.save_checkpoint(tmp_path / "ck", model, opt, **extra)
    fresh = _model(seed=3)
    opt2 = _opt(fresh)
    loaded = commopt.load_checkpoint(tmp_path / "ck", fresh, opt2)
    assert loaded.keys() == extra.keys()
    assert torch.equal(loaded["torch_rng"], extra["torch_rng"])
    assert loaded["np_rng"] == extra["np_rng"] and loaded["flags"] == extra["flags"]
    assert torch.equal(loaded["nested"]["a"][0], torch.ones(2))
    assert loaded["nested"]["a"][1] == extra["nested"]["a"][1] and loaded["ids"] == {1, 2}


def _trained(info, steps: int, **overrides) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = info.make(model.parameters(), **overrides)
    _train(model, opt, range(steps))
    return model, opt


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_a_refused_schedule_changes_nothing_and_its_way_out_passes_through(tmp_path, info):
    # Issue #41.2: another freeze step was refused by the optimizer after the model had been
    # overwritten, with a ValueError, and allow_config_change could not be passed.
    saved_model, saved_opt = _trained(info, info.steps)
    commopt.save_checkpoint(tmp_path / "ck", saved_model, saved_opt, step=info.steps)
    freeze = info.config[info.freeze_key] + 1
    model, opt = _trained(info, 2, freeze=freeze)
    _unchanged_after_refusal(
        tmp_path / "ck",
        model,
        opt,
        rf"cannot be loaded into this optimizer \(nothing was changed\).*"
        rf"{info.freeze_key}: saved {freeze - 1}, now {freeze}.*allow_config_change=True",
    )
    with pytest.warns(UserWarning, match="resuming under a changed config"):
        extra = commopt.load_checkpoint(tmp_path / "ck", model, opt, allow_config_change=True)
    assert extra == {"step": info.steps}
    assert getattr(opt, info.freeze_key) == freeze  # the new config, the saved state
    assert opt.global_state["step"] == info.steps
    for a, b in zip(_params(saved_model), _params(model), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_another_bucket_numel_is_refused_at_the_load_not_the_next_step(tmp_path, info):
    saved_model, saved_opt = _trained(info, info.steps, bucket_numel=16)
    commopt.save_checkpoint(tmp_path / "ck", saved_model, saved_opt)
    model, opt = _trained(info, 2, bucket_numel=8)
    _unchanged_after_refusal(
        tmp_path / "ck",
        model,
        opt,
        r"nothing was changed.*saved exchange buffers do not fit this optimizer's buckets: "
        r"saved \[.*\] elements per bucket, here \[.*\] \(another bucket_numel",
    )
    _train(model, opt, range(2, 4))  # and the refused optimizer still trains


def test_allow_config_change_is_refused_for_a_torch_optimizer(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, range(2))
    commopt.save_checkpoint(tmp_path / "ck", model, opt)
    with pytest.raises(CheckpointError, match="allow_config_change applies to commopt"):
        commopt.load_checkpoint(tmp_path / "ck", model, opt, allow_config_change=True)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_load_state_dict_refuses_before_it_changes_anything(info):
    # The optimizer's own load is all-or-nothing too (check_state_dict runs first).
    _, other = _trained(info, info.steps, bucket_numel=16)
    sd = other.state_dict()
    _, opt = _trained(info, 2, bucket_numel=8)
    before = reload(opt.state_dict())
    opt.check_state_dict(opt.state_dict())  # its own state: accepted
    with pytest.raises(ValueError, match="another bucket_numel"):
        opt.check_state_dict(sd)
    with pytest.raises(ValueError, match="another bucket_numel"):
        opt.load_state_dict(sd)
    assert state_dict_diff(before, opt.state_dict()) == []
    groups = {**sd, "param_groups": sd["param_groups"] * 2}
    with pytest.raises(ValueError, match=r"has 2 parameter group\(s\), this optimizer 1"):
        opt.load_state_dict(groups)
    assert state_dict_diff(before, opt.state_dict()) == []
