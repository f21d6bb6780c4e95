"""The draw of each sampled output position (marscli.verification.draws): its noise is a
function of the seed, the position and the token id only; the draw has exactly the law it
is made from (chi-square, including where the tail wins); a drafter that draws from a close
law with the same noise agrees with the target's draw about as often as the coupling
promises; and a draft vocabulary named by target ids sees the target's noise."""

from __future__ import annotations

import math

import pytest
import torch

from marscli.verification import draws
from marscli.verification.draws import (
    CANDIDATE_RATIO,
    TAIL,
    TAIL_PICK,
    coupled_draw,
    position_keys,
    reference_uniform,
    uniforms,
)


def test_the_noise_is_the_plain_integer_reference():
    """The tensor hash wraps as 64-bit unsigned arithmetic does: any implementation (a GPU's,
    another language's) must reproduce these uniforms."""
    seeds = [0, 5, 123456789, 2**62 + 17]
    positions = [0, 1, 77, 10_000]
    idx = [0, 1, 49151, 151_935, TAIL, TAIL_PICK]
    keys = position_keys(torch.tensor(seeds), torch.tensor(positions))
    got = uniforms(keys[:, None], torch.tensor([idx]))
    for i, (s, t) in enumerate(zip(seeds, positions)):
        for j, v in enumerate(idx):
            assert float(got[i, j]) == reference_uniform(s, t, v)
            assert 0.0 < float(got[i, j]) < 1.0


def test_noise_differs_by_seed_position_and_token():
    k = position_keys(torch.tensor([1, 1, 2]), torch.tensor([3, 4, 3]))
    assert len(set(k.tolist())) == 3
    u = uniforms(k[0], torch.arange(1000))
    assert len(set(u.tolist())) == 1000
    assert 0.45 < float(u.mean()) < 0.55


def chi_square(samples: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    n = samples.numel()
    cnt = torch.bincount(samples, minlength=p.numel()).double()
    exp = p.double() * n
    big = exp >= 5
    # the rare tokens pooled into one cell
    obs = torch.cat([cnt[big], cnt[~big].sum().view(1)])
    want = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = want > 0
    chi = float(((obs[keep] - want[keep]) ** 2 / want[keep]).sum())
    return chi, int(keep.sum()) - 1


def chi_square_limit(dof: int) -> float:
    """About the 0.9999 quantile of a chi-square with dof degrees of freedom."""
    return dof + 4.0 * math.sqrt(2.0 * dof) + 10.0


@pytest.mark.parametrize("shape", ["peaked", "heavy tail", "flat", "filtered"])
def test_a_draw_has_exactly_its_law(shape):
    """Many positions' draws from one law: a chi-square test over the tokens, in laws where
    the candidates cover almost everything and where the tail wins often."""
    V = 400
    g = torch.Generator().manual_seed(0)
    if shape == "peaked":
        p = torch.softmax(torch.randn(V, generator=g) * 4, -1)
    elif shape == "heavy tail":  # most mass far below the top token: the tail wins often
        p = torch.full((V,), 1.0)
        p[0] = 30_000.0
        p = p / p.sum()
        assert float(p[1:].sum()) > 0.01 and float(p[1]) < float(p[0]) * CANDIDATE_RATIO
    elif shape == "flat":
        p = torch.full((V,), 1.0 / V)
    else:
        p = torch.softmax(torch.randn(V, generator=g), -1)
        p[V // 2:] = 0
        p = p / p.sum()
    N = 60_000
    keys = position_keys(torch.full((N,), 11), torch.arange(N))
    got = torch.cat([coupled_draw(p.expand(6000, V), keys[i: i + 6000]) for i in range(0, N, 6000)])
    assert bool((p[got] > 0).all())
    chi, dof = chi_square(got, p)
    assert chi < chi_square_limit(dof), (shape, chi, dof)


def test_a_draw_is_a_function_of_its_key_and_law():
    p = torch.softmax(torch.randn(5, 50), -1)
    keys = position_keys(torch.tensor([3] * 5), torch.arange(5))
    a = coupled_draw(p, keys)
    b = torch.stack([coupled_draw(p[i: i + 1], keys[i: i + 1])[0] for i in range(5)])  # one row at a time
    assert a.tolist() == b.tolist()


def test_close_laws_agree_as_the_coupling_promises():
    """Gumbel-max coupling: P(draw(p) == draw(q)) >= (1 - d) / (1 + d), d = TV(p, q)."""
    V, N = 300, 20_000
    g = torch.Generator().manual_seed(1)
    z = torch.randn(V, generator=g) * 2
    p = torch.softmax(z, -1)
    q = torch.softmax(z + 0.4 * torch.randn(V, generator=g), -1)
    keys = position_keys(torch.full((N,), 2), torch.arange(N))
    a = coupled_draw(p.expand(N, V), keys)
    b = coupled_draw(q.expand(N, V), keys)
    d = 0.5 * float((p - q).abs().sum())
    agree = float((a == b).double().mean())
    assert agree >= (1 - d) / (1 + d) - 0.02, (agree, d)
    # independent noise (another seed) agrees far less often
    other = coupled_draw(q.expand(N, V), position_keys(torch.full((N,), 3), torch.arange(N)))
    assert float((a == other).double().mean()) < agree - 0.3


def test_a_draft_vocabulary_named_by_target_ids_sees_the_targets_noise():
    """A head drafting over a sub-vocabulary (column c is target token ids[c]) draws with the
    noise of the target ids: from the same law it draws what the target draws."""
    V = 60
    ids = torch.arange(0, 2 * V, 2)  # the draft vocabulary: even target ids
    p_small = torch.softmax(torch.randn(V), -1)
    p_full = torch.zeros(2 * V)
    p_full[ids] = p_small
    keys = position_keys(torch.full((500,), 4), torch.arange(500))
    small = coupled_draw(p_small.expand(500, V), keys, token_ids=ids)
    full = coupled_draw(p_full.expand(500, 2 * V), keys)
    assert ids[small].tolist() == full.tolist()


def test_a_point_mass_is_always_drawn():
    p = torch.zeros(3, 10)
    p[0, 7] = 1.0
    p[1, 0] = 1.0
    p[2, 9] = 1.0
    assert coupled_draw(p, position_keys(torch.zeros(3, dtype=torch.long), torch.arange(3))).tolist() == [7, 0, 9]


def test_an_empty_batch():
    assert coupled_draw(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)).numel() == 0
    assert draws.CANDIDATE_RATIO < 1


def test_the_dense_path_draws_what_the_sparse_path_draws(monkeypatch):
    """The GPU's path (every column scored, the tail picked for every row, no host read) and
    the CPU's (the candidates only) give the same token for every key and law: peaked laws,
    flat ones, laws with a heavy tail, point masses and ties; with a draft vocabulary too."""
    gen = torch.Generator().manual_seed(3)
    V = 300
    laws = [torch.softmax(torch.randn(40, V, generator=gen) * scale, -1) for scale in (0.1, 1.0, 4.0, 30.0)]
    point = torch.zeros(3, V)
    point[torch.arange(3), torch.tensor([0, 7, V - 1])] = 1.0
    tie = torch.zeros(2, V)
    tie[:, [3, 9]] = 0.5
    probs = torch.cat(laws + [point, tie])
    keys = position_keys(torch.arange(len(probs)) % 5, torch.arange(len(probs)) * 7 + 1)
    token_ids = torch.randperm(1000, generator=gen)[:V]
    for ids in (None, token_ids):
        sparse = coupled_draw(probs, keys, ids)
        monkeypatch.setattr(draws, "DENSE_DEVICES", frozenset({"cpu"}))
        dense = coupled_draw(probs, keys, ids)
        monkeypatch.setattr(draws, "DENSE_DEVICES", frozenset({"cuda"}))
        assert torch.equal(sparse, dense)
    # and over many keys of one heavy-tailed law: the tail's picks too
    heavy = torch.full((1, V), 0.9 * CANDIDATE_RATIO)
    heavy[0, 5] = 1.0  # every other token below the candidates' bar: ~2.6% of the mass is tail
    heavy = (heavy / heavy.sum()).expand(2000, V)
    keys = position_keys(torch.zeros(2000, dtype=torch.long), torch.arange(2000))
    sparse = coupled_draw(heavy, keys)
    assert (sparse != 5).sum() > 20  # the tail won, and picked
    monkeypatch.setattr(draws, "DENSE_DEVICES", frozenset({"cpu"}))
    assert torch.equal(sparse, coupled_draw(heavy, keys))
