"""The worker's compressor (engine/compress.py): encodings the server reads alike, exact error feedback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_bps._reference import codecs as ref
from torch_bps.config import Config
from torch_bps.engine.compress import Compressor, parse_compressor
from torch_bps.errors import ConfigError
from torch_bps.wire import Codec

SPECS = ["onebit", "topk:0.1", "randomk:0.1", "topk:1", "randomk:0.5"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(SPECS), st.integers(1, 300), st.integers(0, 2**20), st.integers(0, 2**31))
def test_an_encoding_decodes_alike_on_both_ends(spec, n, key, seed):
    """What the worker decodes from an encoded result is what the server's reference decodes from it."""
    c = Compressor(spec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    payload, rnd = c.encode(key, x)
    assert payload.numel() == c.wire_numel(n)
    mine = torch.empty(n)
    c.decode(key, rnd, payload, mine)
    theirs = np.zeros(n, np.float32)
    ref.decode_add(ref.Spec(c.word, 4 * n, payload.numel() * 4, key), rnd, payload.numpy().tobytes(), theirs)
    assert torch.equal(mine, torch.from_numpy(theirs))
    # this round: what went plus what is left is the input (up to the rounding of x - sent)
    torch.testing.assert_close(mine + c.residual(key), x, rtol=0, atol=1e-6 * (1 + float(x.abs().max())))


@pytest.mark.parametrize("spec", SPECS)
def test_worker_error_feedback_is_exact_bookkeeping(spec):
    """Over many rounds, the sum of what was sent (decoded) plus the residual is the sum of the true gradients."""
    c = Compressor(spec)
    gen = torch.Generator().manual_seed(3)
    sent, true = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    for _ in range(50):
        g = torch.randn(1000, generator=gen)
        payload, rnd = c.encode(9, g)
        out = torch.empty(1000)
        c.decode(9, rnd, payload, out)
        sent += out.double()
        true += g.double()
    torch.testing.assert_close(sent + c.residual(9).double(), true, rtol=0, atol=1e-4)
    # and the feedback is what makes it so: the residual carries what the rounds dropped, not noise
    assert c.residual(9).abs().max() < 50


def test_top_k_sends_the_largest_and_keeps_the_rest():
    c = Compressor("topk:0.25")
    x = torch.tensor([0.5, -4.0, 1.0, 3.0, -0.25, 0.0, 2.0, 0.125])
    payload, rnd = c.encode(1, x)
    raw = payload.view(torch.uint8)
    assert raw[:8].view(torch.int32).tolist() == [1, 3]
    assert raw[8:].view(torch.float32).tolist() == [-4.0, 3.0]
    assert c.residual(1).tolist() == [0.5, 0.0, 1.0, 0.0, -0.25, 0.0, 2.0, 0.125]
    payload, _ = c.encode(1, torch.zeros(8))  # the residual goes next
    assert payload.view(torch.uint8)[:8].view(torch.int32).tolist() == [2, 6]


def test_onebit_sends_signs_and_the_mean_magnitude():
    c = Compressor("onebit")
    payload, rnd = c.encode(1, torch.tensor([1.0, -3.0, 2.0, -2.0]))
    raw = payload.view(torch.uint8)
    assert raw[:4].view(torch.float32).item() == 2.0 and raw[4].item() == 0b1010
    out = torch.empty(4)
    c.decode(1, rnd, payload, out)
    assert out.tolist() == [2.0, -2.0, 2.0, -2.0]


@pytest.mark.parametrize("value", ["onebit:0.1", "topk", "topk:0", "randomk:2", "gzip", "topk:x"])
def test_a_bad_compressor_is_a_config_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("BPS_COMPRESSOR", value)
    with pytest.raises(ConfigError, match=rf"BPS_COMPRESSOR='{value}'.*topk:RATIO"):
        Config.resolve()
    with pytest.raises(ValueError):
        parse_compressor(value)


def test_compressor_settings_resolve():
    config = Config.resolve(compressor="randomk:0.01", compress_exclude="bias, norm", compress_min_bytes=1)
    assert config.compressor == "randomk:0.01"
    assert (config.compress_exclude, config.compress_min_bytes) == (("bias", "norm"), 1)
    assert parse_compressor(config.compressor) == (Codec.RANDOMK, 0.01)
    assert Config.resolve(compressor="randomk:0.1", backup_workers=1).compressor
    assert Config.resolve(compressor="randomk:0.1", servers=("10.0.0.1:9000",)).failover  # failover keeps its rounds
