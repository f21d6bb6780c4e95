"""marscli's Python API: load once, generate many times, from a notebook or a script.

    import marscli

    llm = marscli.load(verify="strict")                  # the embedded SmolLM2-135M-Instruct, ngram drafter
    results = llm.generate(["def fibonacci(n):",
                            {"id": "q1", "messages": [{"role": "user", "content": "Name three planets."}]}],
                           max_tokens=48)
    print(results[0]["output"], results[1]["spec"]["acceptance_length"])

`generate` returns the same result dicts, in input order, that `marscli generate` writes as
JSON lines (it is the code path the command runs): a string is a prompt record, a dict is
parsed exactly like a JSONL record (prompt, messages, OpenAI batch lines, per-record
overrides), and a bad record becomes a result with an `error` object. `calibrate` measures
margins on records and returns the profile (marscli.calibration.profiles.Profile).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import io
import json
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from marscli.config import (
    DEFAULT_MAX_TOKENS,
    CalibrateConfig,
    GenerationOptions,
    SamplingParams,
    VerifyConfig,
)
from marscli.errors import InputError, UsageError
from marscli.verification.registry import LOGIT_RATIO

if TYPE_CHECKING:
    from marscli.jobs.setup import Generator, ModelSetup

# marscli.jobs (and through it torch and transformers) is imported inside the functions below:
# `marscli.LLM` and `import marscli` stay light (tests/test_api.py), as `marscli --help` does.

#: What calibrate records as the input's name in a profile made from Python objects.
PYTHON_INPUT_NAME = "<python>"

Record = str | dict[str, Any]


def load(target: str | None = None, draft: str | None = None, *, quiet: bool = True, **options: Any) -> LLM:
    """Load a target (default: the embedded model) and a drafter (default: the profile's, else
    'ngram'; 'none', a draft model, or 'eagle3:PATH'), choose the profile and build the engine.

    The keywords are `marscli generate`'s options (marscli.config.GenerationOptions, the one
    declaration of them), with the same defaults and the same rule: what you pass > the
    profile (`profile=`, else the newest matching one unless auto_profile=False) > defaults.
    verify picks the rule (strict, mars, ratio, topk, typical, regret; docs/verification.md)
    with its knobs: theta (mars), rho (ratio), top_n and delta (topk), epsilon and alpha
    (typical), budget (regret), e.g. load(verify="ratio", rho=0.5). strict_in ("code",
    "answer" or "code,answer") and strict_regex: strict spans, verified strictly whatever the
    rule. job_corpus=False: under strict verification the n-gram drafter keeps to each
    record's own text (by default it also drafts from the call's finished records; outputs
    are the same either way). quiet=False narrates loading on stderr as the CLI does.
    """
    from marscli.io.console import Log
    from marscli.jobs.setup import build_generator, generation_setup

    try:
        opts = GenerationOptions(target=target, draft=draft, **options)
    except TypeError:
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(GenerationOptions)})
        raise UsageError(f"load() got unknown option(s) {', '.join(unknown)}; the options are "
                         f"generate's: {', '.join(f.name for f in dataclasses.fields(GenerationOptions))}") from None
    setup = generation_setup(opts)
    return LLM(build_generator(setup, Log(quiet).info), setup)


def _load_signature() -> inspect.Signature:
    """load's signature as help() and IDEs show it: generate's options as keywords."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("target", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
              inspect.Parameter("draft", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    params += [inspect.Parameter(f.name, kw, default=f.default) for f in dataclasses.fields(GenerationOptions)
               if f.name not in ("target", "draft")]
    params.append(inspect.Parameter("quiet", kw, default=True))
    return inspect.Signature(params)


load.__signature__ = _load_signature()  # type: ignore[attr-defined]


def records_jsonl(records: Record | Iterable[Record]) -> bytes:
    """Strings and dicts -> the JSONL bytes of a file holding them (a string s is the record
    {"prompt": s})."""
    if isinstance(records, (str, dict)):
        records = [records]
    lines = []
    for i, rec in enumerate(records):
        if isinstance(rec, str):
            rec = {"prompt": rec}
        if not isinstance(rec, dict):
            raise UsageError(f"record {i}: give a prompt string or a dict, got {type(rec).__name__}")
        try:
            lines.append(json.dumps(rec, ensure_ascii=False))
        except (TypeError, ValueError) as e:
            raise UsageError(f"record {i} cannot be written as JSON: {e}") from None
    return ("\n".join(lines) + "\n").encode("utf-8") if lines else b""


def records_to_items(records: Record | Iterable[Record] | bytes) -> list:
    """Records -> marscli.io's Requests and RecordErrors, parsed exactly as the lines of a
    JSONL file (the CLI's parser); duplicate ids are refused as the CLI refuses them."""
    from marscli.io.records import find_duplicate_ids, read_requests

    data = records if isinstance(records, bytes) else records_jsonl(records)
    items = list(read_requests(io.BytesIO(data)))
    dup = find_duplicate_ids(items)
    if dup is not None:
        raise InputError(f"duplicate id {dup[0]!r} in records {dup[1] - 1} and {dup[2] - 1}")
    return items


class LLM:
    """Loaded models, drafter, verification and profile (see marscli.load)."""

    def __init__(self, generator: Generator, setup: ModelSetup):
        self.generator = generator
        self.setup = setup

    @property
    def verify(self) -> VerifyConfig:
        """The verification in use (after the profile, if one was chosen)."""
        return self.generator.verify

    @property
    def profile(self):
        """The marscli.calibration.profiles.Profile in use, or None."""
        return self.generator.profile

    def stream(self, records: Record | Iterable[Record], *, max_tokens: int = DEFAULT_MAX_TOKENS,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
               stop: Iterable[str] = (), truncate_prompt: str = "none", timing: bool = True,
               token_ids: bool = False, n: int = 1, logprobs: bool = False,
               top_logprobs: int | None = None, output_format: str = "default",
               strict_keys: bool = False, provenance: bool = False) -> Iterator[dict[str, Any]]:
        """Result dicts in input order, each as soon as it and those before it are done.
        provenance=True: each result carries `provenance` (marscli.engine.provenance)."""
        from marscli.io.openai_format import render
        from marscli.jobs.generate import model_name
        from marscli.jobs.results import ResultOptions
        from marscli.jobs.setup import check_choices, check_rule_modes, choice_options

        check_choices(truncate_prompt=truncate_prompt, output_format=output_format)
        if isinstance(stop, str):
            stop = (stop,)
        sampling = choice_options(SamplingParams(temperature, top_p, top_k, max_tokens, seed, tuple(stop)),
                                  n, logprobs, top_logprobs, provenance)
        gen = self.generator
        check_rule_modes(gen.verify.rule, sampling, "temperature")
        items = records_to_items(records)
        # The OpenAI format's ids: from what decides the results, as the CLI's run fingerprint.
        run_key = hashlib.sha256(json.dumps(
            {"target": getattr(gen.target, "identity", None), "spec": gen.spec_meta,
             "sampling": dataclasses.asdict(sampling), "truncate_prompt": truncate_prompt},
            sort_keys=True, default=str).encode()).hexdigest()
        options = ResultOptions(truncate_prompt, timing, token_ids, output_format, strict_keys,
                                model_name(gen.target), run_key)
        pending: dict[int, dict] = {}
        next_index = 0
        for item, result, _ in gen.results(items, sampling, options):
            pending[item.index] = render(item, result, options)
            while next_index in pending:
                yield pending.pop(next_index)
                next_index += 1

    def generate(self, records: Record | Iterable[Record], **sampling: Any) -> list[dict[str, Any]]:
        """Result dicts in input order, exactly the lines `marscli generate` writes for the
        same records and options (max_tokens, temperature, top_p, top_k, seed, stop,
        truncate_prompt, timing, token_ids, n, logprobs, top_logprobs, output_format,
        strict_keys, provenance). In the "openai" format the ids differ from the CLI's (they come from
        the models and settings, not from the CLI's run fingerprint)."""
        return list(self.stream(records, **sampling))

    def calibrate(self, records: Record | Iterable[Record], *, rule: str = "mars",
                  max_nll_increase: float | None = None, relax_rate: float | None = None,
                  margin: str = LOGIT_RATIO, name: str | None = None, output: str | None = None,
                  max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float = 0.0, top_p: float = 1.0,
                  top_k: int = 0, seed: int = 0, stop: Iterable[str] = (), objective: str = "quality",
                  **knobs: float | None):
        """Collect margins on `records` under strict verification with this drafter, choose
        `rule`'s main knob (mars: theta; ratio: rho; topk: delta at `top_n`; typical: epsilon;
        regret: budget) by one policy (default max_nll_increase=0.02; the main knob given,
        e.g. theta=0.9: fixed) and return the profile; with `output`, also write it there (a
        YAML file generate can use). It is `marscli calibrate`'s collection, on the models
        already loaded (marscli.jobs.calibrate)."""
        from marscli.calibration.profiles import (
            dump_profile,
            parse_profile,
            save_profile,
        )
        from marscli.io.console import Log
        from marscli.jobs.calibrate import (
            calibration_engine,
            choose_policy,
            choose_rule,
            collect_profile,
        )
        from marscli.jobs.setup import check_choices

        gen = self.generator
        if gen.draft.kind == "none":
            raise UsageError("calibrate needs a drafter: load with draft='ngram' or a draft model")
        check_choices(margin)
        sampling = SamplingParams(temperature, top_p, top_k, max_tokens, seed, tuple(stop))
        template, fixed, alpha_given = choose_rule(rule, margin=margin, greedy=sampling.greedy, **knobs)
        policy, value = choose_policy(max_nll_increase, relax_rate, fixed, knob=template.knob[0])
        data = records_jsonl(records)
        items = records_to_items(data)
        if not items:
            raise InputError("no records to calibrate on")
        cfg = CalibrateConfig(input=PYTHON_INPUT_NAME, output=output, name=name, target=self.setup.target,
                              draft=gen.draft, draft_model=self.setup.draft_model, margin=margin,
                              policy=policy, policy_value=value, sampling=sampling,
                              batch_size=self.setup.batch_size, guard=gen.verify.guard, objective=objective,
                              rule=template, alpha_given=alpha_given)
        engine = calibration_engine(cfg, gen.target, gen.draft_loaded)
        doc = collect_profile(cfg, engine, items, gen.target, gen.draft_loaded, Log(quiet=True),
                              input_name=PYTHON_INPUT_NAME,
                              input_sha256=hashlib.sha256(data).hexdigest())  # as a file of these lines
        if output is not None:
            return save_profile(doc, output)
        return parse_profile(dump_profile(doc), PYTHON_INPUT_NAME)
