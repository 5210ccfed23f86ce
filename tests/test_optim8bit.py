"""runtime.backends.optim8bit: the sliced 8-bit AdamW steps exactly as bitsandbytes' own, with one slice's
temporaries."""

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from runtime.backends.optim8bit import SlicedAdamW8bit  # noqa: E402


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    # a tensor of 5 slices and a partial quantisation block, one of exactly one slice, one under 4,096 (fp32 state)
    shapes = [(9, 1000 + 17), (4, 1024), (30, 40)]
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]


def _grads(params, step: int):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * (0.01 * (step + 1)) for p in params]


def test_sliced_steps_equal_the_stock_optimizer_bit_for_bit():
    stock_p, sliced_p = _params(0), _params(0)
    stock = bnb.optim.AdamW8bit(stock_p, lr=1e-2, weight_decay=0.01)
    sliced = SlicedAdamW8bit(sliced_p, lr=1e-2, weight_decay=0.01, slice_elems=2048)
    for step in range(4):
        for ps, opt in ((stock_p, stock), (sliced_p, sliced)):
            for p, g in zip(ps, _grads(ps, step)):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(stock_p, sliced_p):
        assert torch.equal(a, b)
        sa, sb = stock.state[a], sliced.state[b]
        assert sa.keys() == sb.keys()
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
            else:
                assert sa[k] == sb[k], k
    assert stock.state[stock_p[0]]["state1"].dtype == torch.uint8  # the sliced path ran (8-bit state, 5 slices)
    moved = (sliced_p[0] - _params(0)[0]).abs()
    assert (moved[-1] > 0).all() and (moved[0] > 0).all()  # the last, partial slice was stepped too


def test_sliced_state_loads_into_the_stock_optimizer():
    ps = _params(1)
    opt = SlicedAdamW8bit(ps, lr=1e-3, slice_elems=1024)
    for p, g in zip(ps, _grads(ps, 0)):
        p.grad = g
    opt.step()
    stock = bnb.optim.AdamW8bit(_params(1), lr=1e-3)
    stock.load_state_dict(opt.state_dict())
    assert stock.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


@pytest.mark.parametrize("bad", [0, 100, -256])
def test_slice_size_is_a_multiple_of_the_quantisation_block(bad):
    with pytest.raises(ValueError, match="multiple of 256"):
        SlicedAdamW8bit(_params(0), slice_elems=bad)
