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
    CalibrateConfig,
    GenerationOptions,
    SamplingOptions,
    VerifyConfig,
)
from marscli.drafters.kinds import NONE
from marscli.errors import InputError, UsageError
from marscli.verification.registry import LOGIT_RATIO

if TYPE_CHECKING:
    from marscli.jobs.setup import Generator, ModelSetup

# marscli.jobs (and through it torch and transformers) is imported inside the functions below:
# `marscli.LLM` and `import marscli` stay light (tests/cli/test_api.py), as `marscli --help` does.

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


def sampling_options(options: dict[str, Any]) -> SamplingOptions:
    """Keywords -> SamplingOptions; an unknown one is a usage error naming the options."""
    try:
        return SamplingOptions(**options)
    except TypeError:
        names = [f.name for f in dataclasses.fields(SamplingOptions)]
        unknown = sorted(set(options) - set(names))
        raise UsageError(f"unknown option(s) {', '.join(unknown)}; the options are generate's: "
                         f"{', '.join(names)}") from None


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
    from marscli.io.input_index import find_duplicate_ids
    from marscli.io.records import read_requests

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

    def stream(self, records: Record | Iterable[Record], **options: Any) -> Iterator[dict[str, Any]]:
        """Result dicts in input order, each as soon as it and those before it are done.

        The keywords are `marscli generate`'s sampling and output options
        (marscli.config.SamplingOptions, the one declaration of them): max_tokens,
        temperature, top_p, top_k, seed, stop, truncate_prompt, n, logprobs, top_logprobs,
        provenance (each result carries `provenance`: marscli.engine.provenance), timing,
        token_ids, output_format, strict_keys."""
        from marscli.io.openai_format import render
        from marscli.jobs.fingerprint import run_fingerprint, run_key
        from marscli.jobs.results import result_options
        from marscli.jobs.setup import check_rule_modes, check_sampling_options

        opts = sampling_options(options)
        check_sampling_options(opts)
        sampling = opts.params()
        gen = self.generator
        check_rule_modes(gen.verify.rule, sampling, "temperature")
        data = records_jsonl(records)
        items = records_to_items(data)
        # The run fingerprint and key, as `marscli generate -o FILE` makes them for these lines.
        fingerprint = run_fingerprint(
            self.setup, opts, gen.target.identity, gen.draft_loaded.identity if gen.draft_loaded else None,
            {"input": {"sha256": hashlib.sha256(data).hexdigest()}, "profile": gen.spec_meta["profile"]},
            verify=gen.verify)
        result_opts = result_options(opts, gen.target, run_key(fingerprint))
        pending: dict[int, dict] = {}
        next_index = 0
        for item, result, _ in gen.results(items, sampling, result_opts):
            pending[item.index] = render(item, result, result_opts)
            while next_index in pending:
                yield pending.pop(next_index)
                next_index += 1

    def generate(self, records: Record | Iterable[Record], **options: Any) -> list[dict[str, Any]]:
        """Result dicts in input order, exactly the lines `marscli generate -o FILE` writes for
        the same records and options (stream's keywords). In the "openai" format the ids are
        the CLI's too: both come from the run fingerprint (marscli.jobs.fingerprint)."""
        return list(self.stream(records, **options))

    def calibrate(self, records: Record | Iterable[Record], *, rule: str = "mars",
                  max_nll_increase: float | None = None, relax_rate: float | None = None,
                  margin: str = LOGIT_RATIO, name: str | None = None, output: str | None = None,
                  objective: str = "quality", **knobs_and_sampling: Any):
        """Collect margins on `records` under strict verification with this drafter, choose
        `rule`'s main knob (mars: theta; ratio: rho; topk: delta at `top_n`; typical: epsilon;
        regret: budget) by one policy (default max_nll_increase=0.02; the main knob given,
        e.g. theta=0.9: fixed) and return the profile; the other keywords are the sampling
        options (max_tokens, temperature, top_p, top_k, seed, stop: SamplingOptions' sampling
        group, as `marscli calibrate` takes them); with `output`, also write it there (a
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
        if gen.draft.kind == NONE:
            raise UsageError("calibrate needs a drafter: load with draft='ngram' or a draft model")
        check_choices(margin)
        names = SamplingOptions.group("sampling")
        knobs = {k: v for k, v in knobs_and_sampling.items() if k not in names}
        sampling = sampling_options({k: v for k, v in knobs_and_sampling.items() if k in names}).params()
        template, fixed, alpha_given = choose_rule(rule, margin=margin, greedy=sampling.greedy, **knobs)
        policy, value = choose_policy(max_nll_increase, relax_rate, fixed, knob=template.knob[0])
        data = records_jsonl(records)
        items = records_to_items(data)
        if not items:
            raise InputError("no records to calibrate on")
        cfg = CalibrateConfig(input=PYTHON_INPUT_NAME, output=output, name=name, setup=self.setup,
                              margin=margin, policy=policy, policy_value=value, sampling=sampling,
                              guard=gen.verify.guard, objective=objective, rule=template,
                              alpha_given=alpha_given)
        engine = calibration_engine(cfg, gen.target, gen.draft_loaded)
        doc = collect_profile(cfg, engine, items, gen.target, gen.draft_loaded, Log(quiet=True),
                              input_name=PYTHON_INPUT_NAME,
                              input_sha256=hashlib.sha256(data).hexdigest())  # as a file of these lines
        if output is not None:
            return save_profile(doc, output)
        return parse_profile(dump_profile(doc), PYTHON_INPUT_NAME)


def _stream_signature() -> inspect.Signature:
    """stream's and generate's signatures as help() and IDEs show them: the sampling and
    output options as keywords."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("records", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(f.name, kw, default=f.default) for f in dataclasses.fields(SamplingOptions)]
    return inspect.Signature(params)


LLM.stream.__signature__ = _stream_signature()  # type: ignore[attr-defined]
LLM.generate.__signature__ = _stream_signature()  # type: ignore[attr-defined]
