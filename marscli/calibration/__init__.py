"""Calibration: a rule's knob from the target's own margins, and the profile that records it.

- ``collect``: what the target says at every verified draft position of a strict run
  (``MarginCollector``), and the exact replay of that run under any rule (``MarginData``).
- ``policies``: one policy vocabulary for every rule's main knob (max-nll-increase,
  relax-rate, fixed), the trade-off curve, the histogram, ``analyse``; ``match_relax_rate``.
- ``speed``: the speed-up each knob value is predicted to give, from measured step costs.
- ``report``: the curve as a table, the histogram as text or a PNG, the profile document.
- ``profiles``: the profile schema, loading, matching and the search path.
"""
