"""The CPU fast path changes summation order only."""

from __future__ import annotations

import torch
from torch import nn

from marscli.fastpath import BODY_ROWS, HEAD_ROWS, install_cpu_fastpath


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 24)
        self.head = nn.Linear(24, 50, bias=False)
        self.half = nn.Linear(4, 4).to(torch.bfloat16)

    def get_output_embeddings(self):
        return self.head


def test_fastpath_matches_linear_for_every_row_count():
    torch.manual_seed(0)
    m = Toy()
    ref = {name: (mod.weight.clone(), None if mod.bias is None else mod.bias.clone())
           for name, mod in [("body", m.body), ("head", m.head)]}
    assert install_cpu_fastpath(m) == 2  # the bfloat16 layer is left alone
    assert install_cpu_fastpath(m) == 2  # idempotent: patching twice changes nothing
    for rows in range(1, 40):
        x = torch.randn(1, rows, 16)
        h = m.body(x)
        assert h.shape == (1, rows, 24)
        torch.testing.assert_close(h, nn.functional.linear(x, *ref["body"]), rtol=1e-5, atol=1e-5)
        y = m.head(h)
        torch.testing.assert_close(y, nn.functional.linear(h, ref["head"][0]), rtol=1e-5, atol=1e-5)
    assert BODY_ROWS[0] >= 2 and HEAD_ROWS[0] >= 2  # 1-row decode keeps torch's own kernel
