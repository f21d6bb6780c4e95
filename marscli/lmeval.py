"""marscli inside lm-evaluation-harness: the lm-eval model ``marscli``.

    marscli lm-eval --model marscli --tasks gsm8k \\
        --model_args target=qwen2.5-coder-1.5b-instruct,draft=qwen2.5-coder-0.5b-instruct,verify=mars,batch_size=8

``marscli lm-eval ARGS`` (or ``python -m marscli.lmeval ARGS``) is lm-eval's own command line
with this model registered; importing this module registers it, so ``lm_eval.simple_evaluate(
model="marscli", ...)`` works from Python too. It needs the optional extra: ``pip install
"marscli[lmeval]"``.

**model_args** are `marscli generate`'s options (``target``, ``draft``, ``verify``, ``theta``,
``batch_size``, ``dtype``, ``quant``, ``draft_quant``, ``profile``, ...; lm-eval's
``pretrained`` is taken as ``target``), with the same defaults and the same profile rule, plus:

- ``max_gen_toks`` (256): generation length when a request's gen_kwargs give none;
- ``max_length`` (the target's context window): the window of loglikelihood requests;
- ``seed`` (0): the sampling seed of a request's first repeat; its j-th repeat uses seed + j;
- ``stats_file``: a JSONL file that gets one line per generate_until request (task, doc_id,
  repeat, finish reason, completion tokens and marscli's ``spec``: acceptance length, drafted,
  accepted, relaxed...). A summary of each call goes to stderr either way.

lm-eval's ``--batch_size N`` is used when model_args give none; ``auto`` is refused (marscli's
batch size is a setting of the run, not a probe). ``--device`` becomes marscli's ``device``
(except lm-eval's default, cuda:0, which leaves marscli's auto choice).

**generate_until** runs through marscli's engine (`marscli.load` -> `LLM.stream`, the code
path of `marscli generate`): batching, every verification rule, strict spans, the loop
guard; ``until`` are stop strings (the response ends before the first one; EOS stops as
always), ``max_gen_toks`` (and its aliases) the length, ``temperature``, ``top_p``,
``top_k`` and ``do_sample`` the sampling; any other generation key is refused by name rather
than ignored. Contexts too long for the window lose their start, as in lm-eval's own models.
A response is a function of its request, its settings and its repeat number, never of the
batch it ran in (the reproducibility contract).

**loglikelihood** and **loglikelihood_rolling** are computed by the target alone, exactly: one
forward per request (per window for rolling), no drafter, no batching with other requests;
tokenization, the empty-context prefix token and the rolling windows are lm-eval's own
(`TemplateLM`, `lm_eval.utils.get_rolling_token_windows`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from marscli.api import LLM, load
from marscli.config import GenerationOptions
from marscli.errors import UsageError

#: The lm-eval model name.
MODEL_NAME = "marscli"
#: model_args of this adapter that are not generate's options, with their defaults.
ADAPTER_ARGS = {"max_gen_toks": 256, "max_length": None, "seed": 0, "stats_file": None}
_ADAPTER_TYPES = {"max_gen_toks": int, "max_length": int, "seed": int, "stats_file": str}
#: gen_kwargs keys a request may carry (lm-eval's length aliases are folded by normalize_gen_kwargs).
GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k"}
#: lm-eval's --device default, passed to every model whether the user gave it or not.
LM_EVAL_DEFAULT_DEVICE = "cuda:0"
_OPTION_TYPES = typing.get_type_hints(GenerationOptions)


def _convert(key: str, value: Any) -> Any:
    """A model_args value (text from the command line, or a Python value) as `key`'s type."""
    if not isinstance(value, str):
        return value
    kind = _OPTION_TYPES.get(key, _ADAPTER_TYPES.get(key, str))
    names = {getattr(t, "__name__", str(t)) for t in typing.get_args(kind)} or {getattr(kind, "__name__", "")}
    try:
        if "bool" in names:
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
            raise ValueError(value)
        if "int" in names:
            return int(value)
        if "float" in names:
            return float(value)
    except ValueError:
        want = "true or false" if "bool" in names else "a number"
        raise UsageError(f"model_args {key}={value}: expected {want}") from None
    return value


def parse_model_args(text: str) -> dict[str, Any]:
    """``key=value,key=value`` -> typed values (by generate's option types; `none` stays text,
    so ``draft=none`` means no drafter, as on marscli's command line)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"model_args: expected key=value, got {part!r}")
        out[key.strip()] = _convert(key.strip(), value.strip())
    return out


@register_model(MODEL_NAME)
class MarscliLM(TemplateLM):
    """lm-eval's model interface over a loaded `marscli.LLM` (see the module docstring)."""

    def __init__(self, llm: LLM | None = None, **model_args: Any) -> None:
        super().__init__()
        if "pretrained" in model_args:  # lm-eval's usual name for the model
            if model_args.get("target") not in (None, model_args["pretrained"]):
                raise UsageError("model_args: give target or pretrained, not both")
            model_args["target"] = model_args.pop("pretrained")
        adapter = {k: model_args.pop(k, default) for k, default in ADAPTER_ARGS.items()}
        adapter = {k: _convert(k, v) for k, v in adapter.items()}
        if adapter["max_gen_toks"] < 1 or (adapter["max_length"] is not None and adapter["max_length"] < 2):
            raise UsageError("model_args: max_gen_toks must be at least 1 and max_length at least 2")
        options = {f.name for f in dataclasses.fields(GenerationOptions)}
        unknown = sorted(set(model_args) - options)
        if unknown:
            raise UsageError(f"model_args: unknown {', '.join(unknown)}; marscli takes generate's options "
                             f"({', '.join(sorted(options))}) and {', '.join(ADAPTER_ARGS)}")
        if llm is None:
            llm = load(**{k: _convert(k, v) for k, v in model_args.items()})
        elif model_args:
            raise UsageError("give a loaded LLM or model_args, not both")
        self.llm = llm
        target = llm.generator.target
        self.model, self.tokenizer = target.model, target.tokenizer
        self._device = target.device
        self.max_gen_toks = int(adapter["max_gen_toks"])
        self.max_length = int(adapter["max_length"] or target.context_length or 2048)
        self.seed = int(adapter["seed"])
        self.stats_file = adapter["stats_file"]
        self.stats: list[dict[str, Any]] = []  # one entry per generate_until request, in order

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MarscliLM:
        return cls.create_from_arg_obj(parse_model_args(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> MarscliLM:
        args = dict(arg_dict)
        extra = additional_config or {}
        # lm-eval's --batch_size (default 1) applies only where model_args give none.
        if extra.get("batch_size") is not None and "batch_size" not in args:
            args["batch_size"] = extra["batch_size"]
        if isinstance(args.get("batch_size"), str) and args["batch_size"].startswith("auto"):
            raise UsageError("batch_size auto: marscli takes a number (its batch size is a setting "
                             "of the run, not a probe)")
        # lm-eval passes its --device default (cuda:0) whether given or not: that one leaves
        # marscli's own choice (auto: a GPU where there is one).
        if extra.get("device") not in (None, LM_EVAL_DEFAULT_DEVICE) and "device" not in args:
            args["device"] = extra["device"]
        return cls(**args)

    # --- tokens -----------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # As marscli's own prompts are encoded (marscli.engine.prompts): the tokenizer's default.
        if add_special_tokens is None:
            return self.tokenizer.encode(string)
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # --- likelihoods: the target alone --------------------------------------------------------

    @torch.inference_mode()
    def _continuation_logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log p(continuation | context) and whether greedy decoding gives it, from one forward
        over the last max_length tokens (lm-eval's causal convention)."""
        whole = (context + continuation)[-(self.max_length + 1):]
        inputs = torch.tensor([whole[:-1]], device=self.device)
        n = len(continuation)
        logits = self.model(input_ids=inputs, use_cache=False).logits[0, -n:].float()
        logp = torch.log_softmax(logits, dim=-1)
        want = torch.tensor(whole[-n:], device=logp.device)
        greedy = bool((logp.argmax(dim=-1) == want).all())
        return float(logp.gather(1, want[:, None]).double().sum()), greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for key, context, continuation in requests:
            if not continuation:
                raise UsageError(f"loglikelihood request {key!r}: the continuation encodes to no tokens")
            result = self._continuation_logprob(list(context), list(continuation))
            out.append(result)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (string,) = req.args
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = sum(self._continuation_logprob(list(ctx), list(cont))[0] for ctx, cont in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out

    # --- generation: marscli's engine ---------------------------------------------------------

    def _record(self, i: int, context: str, gen_kwargs: dict, repeat: int) -> dict[str, Any]:
        unknown = sorted(set(gen_kwargs) - GEN_KWARGS - {"max_new_tokens", "max_tokens", "max_completion_tokens"})
        if unknown:
            raise UsageError(f"generate_until request {i}: gen_kwargs {', '.join(unknown)} are not supported by "
                             f"marscli (it takes {', '.join(sorted(GEN_KWARGS))})")
        kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        stop = [s for s in handle_stop_sequences(kw.get("until"), eos=None) if s]
        sample = bool(kw.get("do_sample")) and float(kw.get("temperature", 0.0)) > 0
        rec: dict[str, Any] = {"id": str(i), "prompt": context, "max_tokens": int(kw["max_gen_toks"]),
                               "stop": stop, "seed": self.seed + repeat,
                               "temperature": float(kw["temperature"]) if sample else 0.0}
        if sample:
            rec["top_p"] = float(kw.get("top_p", 1.0))
            rec["top_k"] = int(kw.get("top_k", 0))
        return rec

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        seen: Counter[tuple[str, str]] = Counter()
        records, metas = [], []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            # lm-eval repeats a request (`repeats: n`) by listing it n times: the j-th gets seed + j.
            key = (getattr(req, "task_name", None), getattr(req, "doc_id", None), getattr(req, "idx", None),
                   context, json.dumps(gen_kwargs, sort_keys=True, default=str))
            repeat = seen[key]
            seen[key] += 1
            records.append(self._record(i, context, dict(gen_kwargs), repeat))
            metas.append({"args": req.args, "task": getattr(req, "task_name", None),
                          "doc_id": getattr(req, "doc_id", None), "repeat": repeat})
        responses: list[str] = []
        stats = []
        for rec, result, meta in zip(records, self.llm.stream(records, truncate_prompt="left"), metas, strict=True):
            if result.get("error"):
                err = result["error"]
                raise UsageError(f"generate_until request {rec['id']}: {err.get('message', err)}")
            text = result["output"]  # already ends before its first stop string (the engine's StopChecker)
            responses.append(text)
            self.cache_hook.add_partial("generate_until", meta.pop("args"), text)
            stats.append({**meta, "finish_reason": result["finish_reason"],
                          "completion_tokens": result["usage"]["completion_tokens"], "spec": result["spec"]})
        self.stats.extend(stats)
        if self.stats_file:
            with Path(self.stats_file).open("a", encoding="utf-8") as f:
                for line in stats:
                    f.write(json.dumps(line, default=str) + "\n")
        print(summary(stats), file=sys.stderr)
        return responses


def summary(stats: list[dict[str, Any]]) -> str:
    """One line on a generate_until call: requests, tokens, drafts accepted, relaxed, tau."""
    tokens = sum(s["completion_tokens"] for s in stats)
    steps = sum(s["spec"].get("steps", 0) for s in stats)
    drafted = sum(s["spec"].get("drafted", 0) for s in stats)
    accepted = sum(s["spec"].get("accepted", 0) for s in stats)
    relaxed = sum(s["spec"].get("relaxed", 0) for s in stats)
    tau = f"{tokens / steps:.2f}" if steps else "-"
    return (f"marscli: {len(stats)} generate_until requests, {tokens} tokens, {accepted}/{drafted} drafts "
            f"accepted ({relaxed} relaxed), tokens per target forward {tau}")


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the marscli model registered (this module is imported)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = ["lm-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
