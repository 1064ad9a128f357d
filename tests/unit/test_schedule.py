"""LR schedules against hand-computed values, and the LambdaLR built from them."""

from __future__ import annotations

import math

import pytest
import torch

from tapetrain.config.sections import OptimSection
from tapetrain.train.schedule import build_scheduler, lr_at


def optim(schedule: str, **kw) -> OptimSection:
    return OptimSection(**{"lr": 1.0, "min_lr": 0.1, "schedule": schedule, "warmup_steps": 10, **kw})


# 110 steps with 10 warmup: decay progress p = (s - 10) / 100.
@pytest.mark.parametrize(
    "schedule, kw, step, expected",
    [
        # warmup: lr · (s + 1) / W, the same for every schedule
        ("cosine", {}, 0, 0.1),
        ("cosine", {}, 4, 0.5),
        ("cosine", {}, 9, 1.0),
        ("linear", {}, 4, 0.5),
        ("constant", {}, 0, 0.1),
        # cosine: 0.1 + 0.9 · (1 + cos(π p)) / 2
        ("cosine", {}, 10, 1.0),
        ("cosine", {}, 35, 0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2),  # p = 1/4
        ("cosine", {}, 60, 0.55),  # p = 1/2
        ("cosine", {}, 85, 0.1 + 0.9 * (1 - math.sqrt(0.5)) / 2),  # p = 3/4
        ("cosine", {}, 110, 0.1),
        ("cosine", {}, 500, 0.1),  # past the end: stays at min_lr
        # linear: 0.1 + 0.9 · (1 - p)
        ("linear", {}, 10, 1.0),
        ("linear", {}, 35, 0.775),
        ("linear", {}, 60, 0.55),
        ("linear", {}, 110, 0.1),
        # polynomial: 0.1 + 0.9 · (1 - p) ** power
        ("polynomial", {"power": 2.0}, 60, 0.325),
        ("polynomial", {"power": 2.0}, 35, 0.60625),
        ("polynomial", {"power": 0.5}, 85, 0.55),
        ("polynomial", {"power": 1.0}, 35, 0.775),  # power 1 = linear
        ("polynomial", {"power": 2.0}, 110, 0.1),
        # constant
        ("constant", {}, 10, 1.0),
        ("constant", {}, 109, 1.0),
        ("constant", {}, 1000, 1.0),
    ],
)
def test_schedules_match_hand_computed_values(schedule, kw, step, expected):
    assert lr_at(step, optim(schedule, **kw), total_steps=110) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 0.1),
        (9, 1.0),
        (10, 1.0),
        (50, 1.0),
        (79, 1.0),
        (80, 1.0),
        (85, 0.775),
        (90, 0.55),
        (99, 0.145),
        (100, 0.1),
        (150, 0.1),
    ],
)
def test_wsd_stable_then_linear_decay_over_the_last_decay_ratio(step, expected):
    # 100 steps, 10 warmup, decay_ratio 0.2 -> decay over steps 80..100: 0.1 + 0.9 · (1 - (s - 80) / 20)
    assert lr_at(step, optim("wsd", decay_ratio=0.2), total_steps=100) == pytest.approx(expected, abs=1e-12)


def test_warmup_ratio_and_no_warmup():
    paper = OptimSection(lr=1e-4, min_lr=0.0, schedule="polynomial", power=1.0, warmup_ratio=0.02)
    assert paper.warmup_for(10000) == 200
    assert lr_at(0, paper, 10000) == pytest.approx(1e-4 / 200)
    assert lr_at(99, paper, 10000) == pytest.approx(0.5e-4)
    assert lr_at(200, paper, 10000) == pytest.approx(1e-4)
    assert lr_at(5100, paper, 10000) == pytest.approx(0.5e-4)  # halfway through the 9800 decay steps
    assert lr_at(10000, paper, 10000) == pytest.approx(0.0)
    plain = OptimSection(lr=0.5, min_lr=0.0, schedule="cosine")
    assert lr_at(0, plain, 100) == 0.5 and lr_at(50, plain, 100) == pytest.approx(0.25)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "polynomial", "constant", "wsd"])
def test_lambda_lr_follows_lr_at_and_resumes(schedule):
    cfg = optim(schedule, power=2.0, decay_ratio=0.3)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total_steps=40)
    seen = []
    for _ in range(25):
        seen.append(opt.param_groups[0]["lr"])  # the lr the next update uses
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, cfg, 40) for s in range(25)], abs=1e-12)

    opt2 = torch.optim.SGD([param], lr=cfg.lr)
    resumed = build_scheduler(opt2, cfg, total_steps=40)
    opt2.load_state_dict(opt.state_dict())  # a resume restores both (the optimizer holds the current lr)
    resumed.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(25, cfg, 40))
    opt2.step()
    resumed.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(26, cfg, 40))
