"""DeepSpeed config translation: the configs of DeepSpeed's own tutorials, and every refusal."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import commopt
from commopt.deepspeed_compat import DeepSpeedConfigWarning, translate_deepspeed_config

# From the 1-bit Adam tutorial, section 3.2 "Configuration for BERT Pre-training with DeepSpeed
# and 1-bit Adam enabled" (https://www.deepspeed.ai/tutorials/onebit-adam/).
BERT_ONEBIT_ADAM = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 16,
    "steps_per_print": 100,
    "prescale_gradients": False,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {
            "lr": 4e-4,
            "weight_decay": 0.01,
            "bias_correction": False,
            "freeze_step": 23000,
            "comm_backend_name": "nccl",
        },
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}

# From the 1-bit LAMB tutorial, section 1.4 "Configuration of 1-bit LAMB"
# (https://www.deepspeed.ai/tutorials/onebit-lamb/).
BERT_ONEBIT_LAMB = {
    "train_batch_size": 65536,
    "train_micro_batch_size_per_gpu": 64,
    "optimizer": {
        "type": "OneBitLamb",
        "params": {
            "lr": 11e-3,
            "max_coeff": 0.3,
            "min_coeff": 0.01,
            "freeze_step": 1000,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
            "coeff_beta": 0.9,
            "factor_max": 4.0,
            "factor_min": 0.5,
            "factor_threshold": 0.1,
        },
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}

# From the 0/1 Adam tutorial, section 1.4 "Configuration of 0/1 Adam"
# (https://www.deepspeed.ai/tutorials/zero-one-adam/).
BERT_ZERO_ONE_ADAM = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {
        "type": "ZeroOneAdam",
        "params": {
            "lr": 1e-3,
            "weight_decay": 0.01,
            "bias_correction": False,
            "var_freeze_step": 1000,
            "var_update_scaler": 16,
            "local_step_scaler": 1000,
            "local_step_clipper": 16,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}

# From the configuration reference, "Optimizer Parameters" (https://www.deepspeed.ai/docs/config-json/).
REFERENCE_ONEBIT_ADAM = {
    "type": "OneBitAdam",
    "params": {
        "lr": 0.001,
        "betas": [0.8, 0.999],
        "eps": 1e-8,
        "weight_decay": 3e-7,
        "freeze_step": 400,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    },
}
REFERENCE_ONEBIT_LAMB = {
    "type": "OneBitLamb",
    "params": {
        "lr": 11e-3,
        "weight_decay": 0.01,
        "bias_correction": False,
        "max_coeff": 0.3,
        "min_coeff": 0.01,
        "freeze_step": 1000,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
        "coeff_beta": 0.9,
        "factor_max": 4.0,
        "factor_min": 0.5,
        "factor_threshold": 0.1,
    },
}

TUTORIALS = {
    "bert-1bit-adam": (BERT_ONEBIT_ADAM, commopt.OnebitAdam),
    "bert-1bit-lamb": (BERT_ONEBIT_LAMB, commopt.OnebitLamb),
    "bert-01-adam": (BERT_ZERO_ONE_ADAM, commopt.ZeroOneAdam),
    "reference-1bit-adam": (REFERENCE_ONEBIT_ADAM, commopt.OnebitAdam),
    "reference-1bit-lamb": (REFERENCE_ONEBIT_LAMB, commopt.OnebitLamb),
}

# Keys whose value the commopt optimizer must carry, and where it keeps each (independent of
# the translator's own tables).
WHERE = {
    "lr": "group",
    "eps": "group",
    "weight_decay": "group",
    "betas": "group",
    "bias_correction": "group",
    "max_coeff": "attr",
    "min_coeff": "attr",
    "coeff_beta": "attr",
    "factor_max": "attr",
    "factor_min": "attr",
    "factor_threshold": "attr",
    "freeze_step": "attr",
    "var_freeze_step": "attr",
    "var_update_scaler": "attr",
    "local_step_scaler": "attr",
    "local_step_clipper": "attr",
}


def _params():
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def _build(config, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = commopt.from_deepspeed_config(_params(), config, **kw)
    return opt, [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]


@pytest.mark.parametrize("name", sorted(TUTORIALS))
def test_tutorial_configs_translate(name):
    config, cls = TUTORIALS[name]
    opt, caught = _build(config)
    assert type(opt) is cls
    block = config.get("optimizer", config)
    group = opt.param_groups[0]
    for key, value in block["params"].items():
        if key in ("comm_backend_name", "cuda_aware"):
            continue
        if key == "bias_correction" and cls is commopt.OnebitLamb:
            assert "bias_correction" not in group  # no bias correction in LAMB
            continue
        if key == "bias_correction" and cls is commopt.ZeroOneAdam:
            # DeepSpeed ignores it; commopt's default (True) applies, not the config's value
            assert group["bias_correction"] is True
            continue
        where = WHERE[key]
        got = group[key] if where == "group" else getattr(opt, key)
        if key == "freeze_step":  # DeepSpeed counts its initialising first step (#15.12)
            value -= 1
        assert (list(got) if key == "betas" else got) == value, key
    assert opt.requested_backend is None  # "nccl": resolved lazily (init / torch.distributed)
    # Engine keys of a whole config are reported, not silently dropped.
    if "optimizer" in config:
        assert len(caught) == 1
        message = str(caught[0].message)
        assert "'gradient_clipping'" in message and "'fp16'" in message
        assert "GradScaler" in message


@pytest.mark.parametrize("name", sorted(TUTORIALS))
def test_round_trip(name):
    config, cls = TUTORIALS[name]
    opt, _ = _build(config)
    block = commopt.to_deepspeed_config(opt)
    again, _ = _build(block)
    assert type(again) is cls
    assert commopt.to_deepspeed_config(again) == block
    block_in = config.get("optimizer", config)
    for key, value in block_in["params"].items():
        if key in block["params"]:
            assert block["params"][key] == value, key


def test_type_is_case_insensitive_and_json_path(tmp_path):
    path = tmp_path / "ds.json"
    config = copy.deepcopy(BERT_ZERO_ONE_ADAM)
    config["optimizer"]["type"] = "zerooneADAM"
    path.write_text(json.dumps(config))
    opt, _ = _build(str(path))
    assert isinstance(opt, commopt.ZeroOneAdam)
    assert opt.local_step_scaler == 1000


def test_no_meaning_keys_are_reported():
    block = {
        "type": "OneBitLamb",
        "params": {"lr": 1e-3, "bias_correction": True, "max_grad_norm": 1.0, "amsgrad": False},
    }
    _, caught = _build(block)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "bias_correction=True: 1-bit LAMB uses m and v without bias correction" in message
    assert "max_grad_norm=1.0" in message and "clip gradients" in message
    assert "amsgrad=False" in message


def test_cuda_aware_without_mpi_is_reported():
    block = {"type": "OneBitAdam", "params": {"cuda_aware": True, "comm_backend_name": "nccl"}}
    _, caught = _build(block)
    assert "cuda_aware=True with comm_backend_name='nccl': only MPI uses it" in str(
        caught[0].message
    )


def test_mpi_backend_mapping():
    pytest.importorskip("mpi4py", reason="the 'mpi' mapping builds an MpiBackend")
    block = {"type": "OneBitAdam", "params": {"comm_backend_name": "mpi", "cuda_aware": True}}
    opt, caught = _build(block)
    assert not caught
    assert opt.requested_backend.name == "mpi" and opt.requested_backend.cuda_aware is True
    assert commopt.to_deepspeed_config(opt)["params"]["comm_backend_name"] == "mpi"


def test_explicit_backend_wins():
    be = commopt.SingleProcessBackend()
    opt, _ = _build({"type": "OneBitAdam", "params": {"comm_backend_name": "mpi"}}, backend=be)
    assert opt.requested_backend is be


def test_overrides_replace_auto():
    block = {"type": "OneBitAdam", "params": {"lr": "auto", "freeze_step": 10}}
    with pytest.raises(ValueError, match=r"param 'lr' is 'auto'.*pass it as a keyword"):
        _build(block)
    opt, _ = _build(block, lr=3e-4)
    assert opt.param_groups[0]["lr"] == 3e-4 and opt.freeze_step == 9


@pytest.mark.parametrize(
    ("block", "match"),
    [
        ({"type": "Adam", "params": {}}, r"unsupported optimizer type 'Adam'.*'OneBitAdam'"),
        (
            {"type": "OneBitAdam", "params": {"freeze_stepp": 3}},
            r"unknown key\(s\) \['freeze_stepp'\] in the OneBitAdam params.*'freeze_step'",
        ),
        (
            {"type": "ZeroOneAdam", "params": {"freeze_step": 3}},
            r"unknown key\(s\) \['freeze_step'\] in the ZeroOneAdam params",
        ),
        (
            {"type": "OneBitAdam", "params": {"amsgrad": True}},
            r"amsgrad=True is refused: AMSGrad is not supported",
        ),
        (
            {"type": "OneBitAdam", "params": {"eps_inside_sqrt": True}},
            r"eps_inside_sqrt=True is refused",
        ),
        (
            {"type": "OneBitAdam", "params": {"comm_backend_name": "smoke"}},
            r"comm_backend_name='smoke' is unknown",
        ),
        ({"type": "OneBitAdam", "params": {"betas": [0.9]}}, r"'betas' must be two numbers"),
        ({"type": "OneBitAdam", "parms": {}}, r"unknown key\(s\) \['parms'\] in the 'optimizer'"),
        ({"train_batch_size": 8}, r"neither an 'optimizer' block nor a 'type'"),
        (
            {"type": "OneBitAdam", "params": {"freeze_step": -3}},
            r"freeze_step=-3 must be >= 0",
        ),
        (
            {"type": "ZeroOneAdam", "params": {"var_freeze_step": -1}},
            r"Invalid var_freeze_step: -1",
        ),
    ],
)
def test_refusals(block, match):
    with pytest.raises(ValueError, match=match):
        _build(block)


def test_unreadable_path(tmp_path):
    with pytest.raises(ValueError, match="cannot read the DeepSpeed config"):
        _build(str(tmp_path / "missing.json"))


def test_translate_only():
    name, kwargs, ignored = translate_deepspeed_config(BERT_ONEBIT_ADAM)
    assert name == "OnebitAdam"
    assert kwargs == {
        "lr": 4e-4,
        "weight_decay": 0.01,
        "bias_correction": False,
        "freeze_step": 22999,
        "backend_spec": ("nccl", False),
    }
    assert set(ignored) == {"prescale_gradients", "gradient_clipping", "fp16"}


def test_translated_optimizer_trains():
    # The tutorial's 1-bit Adam, with a short warmup, is Adam on one rank: it must reduce a loss.
    config = copy.deepcopy(BERT_ONEBIT_ADAM)
    config["optimizer"]["params"]["freeze_step"] = 5
    config["optimizer"]["params"]["lr"] = 0.05
    w = torch.nn.Parameter(torch.tensor([2.0, -3.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        opt = commopt.from_deepspeed_config([w], config)
    first = float((w.detach() ** 2).sum())
    for _ in range(30):
        opt.zero_grad()
        (w**2).sum().backward()
        opt.step()
    assert float((w.detach() ** 2).sum()) < 0.5 * first


# -- value types (issue #15.8) --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "params", "match"),
    [
        (
            "OneBitAdam",
            {"bias_correction": "false"},
            r"'bias_correction' = 'false' is str.*true or false",
        ),
        ("OneBitLamb", {"cuda_aware": "false"}, r"'cuda_aware' = 'false' is str.*true or false"),
        ("OneBitAdam", {"lr": "1e-3"}, r"'lr' = '1e-3' is str \(a JSON string.*expected a number"),
        ("OneBitAdam", {"lr": None}, r"'lr' = None is NoneType \(null.*expected a number"),
        ("OneBitAdam", {"lr": True}, r"'lr' = True is bool; expected a number"),
        (
            "OneBitAdam",
            {"freeze_step": 10.5},
            r"'freeze_step' = 10.5 is float; expected an integer",
        ),
        ("ZeroOneAdam", {"var_update_scaler": "16"}, r"'var_update_scaler' = '16' is str.*integer"),
        ("OneBitAdam", {"betas": ["0.9", 0.999]}, r"'betas' = \['0.9', 0.999\].*two numbers"),
        ("OneBitAdam", {"amsgrad": "true"}, r"'amsgrad' = 'true' is str.*true or false"),
        (
            "OneBitAdam",
            {"comm_backend_name": 3},
            r"'comm_backend_name' = 3 is int; expected a string",
        ),
        ("OneBitLamb", {"max_coeff": [0.3]}, r"'max_coeff' = \[0.3\] is list; expected a number"),
    ],
)
def test_wrong_value_types_name_key_value_and_type(kind, params, match):
    with pytest.raises(TypeError, match=match):
        _build({"type": kind, "params": params})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"lr": Infinity}', r"'lr' = inf is not a finite number"),
        ('{"eps": NaN}', r"'eps' = nan is not a finite number"),
        ('{"betas": [0.9, -Infinity]}', r"'betas' = \[0.9, -inf\] is not a finite number"),
        ('{"freeze_step": Infinity}', r"'freeze_step' = inf is not a finite number"),
    ],
)
def test_json_infinity_and_nan_are_refused(text, match):
    # issue 41: {"lr": Infinity} was accepted (Python's json reads it as inf)
    with pytest.raises(ValueError, match=match):
        _build({"type": "OneBitAdam", "params": json.loads(text)})


def test_params_must_be_an_object():
    with pytest.raises(
        TypeError, match=r"OneBitAdam 'params' = \[\{'lr': 0.1\}\] is list; expected a dict"
    ):
        _build({"type": "OneBitAdam", "params": [{"lr": 0.1}]})
    opt, _ = _build({"type": "OneBitAdam", "params": None})  # null: the defaults
    assert isinstance(opt, commopt.OnebitAdam)


def test_integral_floats_are_step_counts():
    # JSON writers often give 1e5 for 100000: a float with an integer value is a valid count.
    opt, _ = _build({"type": "ZeroOneAdam", "params": {"var_freeze_step": 1e5, "lr": 1}})
    assert opt.var_freeze_step == 100000 and isinstance(opt.var_freeze_step, int)


# -- step counting (issue #15.12) -----------------------------------------------------------------
# An independent model of DeepSpeed 0.19's control flow (runtime/fp16/onebit/{adam,lamb,zoadam}.py):
# the first step() only initialises state, is counted (k = 1), and returns before the freeze
# check; 1-bit Adam/LAMB freeze after the step whose count k >= freeze_step, 0/1 Adam after the
# step whose count k > var_freeze_step.
def _deepspeed_warmup_updates(kind: str, freeze: int, calls: int) -> int:
    frozen, updates = False, 0
    for k in range(2, calls + 1):
        if not frozen:
            updates += 1
        frozen = frozen or (k > freeze if kind == "ZeroOneAdam" else k >= freeze)
    return updates


def _commopt_variance_updates(opt, w: torch.nn.Parameter, steps: int) -> int:
    """Steps in which v changed (at n = 1 and with var_update_scaler large: the warmup steps)."""
    g = torch.Generator().manual_seed(0)
    changed = 0
    for _ in range(steps):
        before = opt.state[w]["exp_avg_sq"].clone() if opt.state[w] else None
        w.grad = torch.randn(w.shape, generator=g)
        opt.step()
        changed += before is None or not torch.equal(before, opt.state[w]["exp_avg_sq"])
    return changed


@pytest.mark.parametrize("kind", ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"])
@pytest.mark.parametrize("freeze", [0, 1, 2, 3, 7])
def test_same_config_same_number_of_warmup_updates(kind, freeze):
    calls = 12  # DeepSpeed step() calls; commopt needs one fewer (no initialising step)
    key = "var_freeze_step" if kind == "ZeroOneAdam" else "freeze_step"
    params = {"lr": 1e-3, key: freeze}
    if kind == "ZeroOneAdam":
        params.update(var_update_scaler=1000, local_step_scaler=1000)  # every phase-A step: v
    w = torch.nn.Parameter(torch.ones(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        opt = commopt.from_deepspeed_config([w], {"type": kind, "params": params})
    got = _commopt_variance_updates(opt, w, calls - 1)
    assert got == _deepspeed_warmup_updates(kind, freeze, calls), (kind, freeze)
    # ... and to_deepspeed_config gives a config with that same count back.
    back = commopt.to_deepspeed_config(opt)["params"][key]
    assert _deepspeed_warmup_updates(kind, back, calls) == got


@pytest.mark.parametrize(("ours", "theirs"), [(1, 2), (5, 6), (23000, 23001)])
def test_to_deepspeed_config_inverts_the_freeze_step(ours, theirs):
    opt = commopt.OnebitAdam(_params(), freeze_step=ours)
    assert commopt.to_deepspeed_config(opt)["params"]["freeze_step"] == theirs
    again, _ = _build(commopt.to_deepspeed_config(opt))
    assert again.freeze_step == ours
