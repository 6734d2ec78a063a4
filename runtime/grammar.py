"""Constrained decoding: a grammar (JSON schema, any JSON object, regex, EBNF) compiled by xgrammar into a
per-row matcher whose token mask the one sampler applies (``runtime.sampling.logits_to_probs(mask=...)``).

``Grammar`` is compiled once per (spec, tokenizer) and shared; ``grammar.matcher()`` gives one row's state
(``TokenConstraint``): ``mask()`` -> bool [V] of the tokens that may come next, ``accept(token)``,
``rollback(n)`` (speculative decoding advances through drafted tokens and rolls back on rejection), and
``complete``: the text so far is a whole sentence of the grammar. Output that stops before that (max_tokens, a
stop string) is reported incomplete by every decoding loop, never as valid.

xgrammar is imported lazily: nothing here costs anything unless a grammar is used.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")


class GrammarError(ValueError):
    """A grammar that cannot be compiled (bad schema, regex or EBNF), with xgrammar's reason."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KINDS
    source: str = ""  # the JSON schema (text), regex or EBNF; empty for json_object

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; choose from {GRAMMAR_KINDS}")
        if self.kind != "json_object" and not self.source:
            raise GrammarError(f"a {self.kind} grammar needs its source text")
        if self.kind == "json_schema":
            try:
                json.loads(self.source)
            except json.JSONDecodeError as err:
                raise GrammarError(f"the JSON schema is not valid JSON: {err}") from None


_COMPILERS: dict[tuple, tuple] = {}  # (tokenizer id, vocab size, stop ids) -> (tokenizer, GrammarCompiler)


def _compiler(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """One xgrammar GrammarCompiler per tokenizer (building its TokenizerInfo reads the whole vocabulary).
    tokenizer: a HF tokenizer, or a list of token strings (tests, tiny models)."""
    import xgrammar as xgr

    key = (id(tokenizer), vocab_size, stop_ids)
    if key not in _COMPILERS:
        if isinstance(tokenizer, list | tuple):
            info = xgr.TokenizerInfo(list(tokenizer), vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        else:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        _COMPILERS[key] = (tokenizer, xgr.GrammarCompiler(info, max_threads=1))  # keep tokenizer: id stays valid
    return _COMPILERS[key][1]


class Grammar:
    """A compiled grammar for one tokenizer and vocabulary; stop_ids are the tokens that end a sentence."""

    def __init__(self, spec: GrammarSpec, tokenizer, vocab_size: int, stop_ids: list[int]):
        if not stop_ids:
            raise GrammarError("constrained decoding needs at least one stop (EOS) token id to end the output")
        self.spec, self.vocab_size, self.stop_ids = spec, vocab_size, sorted(set(stop_ids))
        compiler = _compiler(tokenizer, vocab_size, tuple(self.stop_ids))
        try:
            # JSON without free whitespace (", " and ": " separators): small models otherwise wander into
            # endless runs of whitespace tokens, which the grammar would allow
            if spec.kind == "json_schema":
                self.compiled = compiler.compile_json_schema(spec.source, any_whitespace=False)
            elif spec.kind == "json_object":  # any object (xgrammar's builtin JSON grammar allows any value)
                self.compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.kind == "regex":
                self.compiled = compiler.compile_regex(spec.source)
            else:
                self.compiled = compiler.compile_grammar(spec.source)
        except RuntimeError as err:  # xgrammar reports parse errors as RuntimeError with a C++ location prefix
            reason = str(err).strip().splitlines()[0].split(": ", 1)[-1]
            raise GrammarError(f"cannot compile the {spec.kind} grammar: {reason}") from None

    def matcher(self) -> TokenConstraint:
        return TokenConstraint(self)


class TokenConstraint:
    """One row's position in a Grammar: the allowed next tokens, advanced and rolled back token by token."""

    def __init__(self, grammar: Grammar):
        import xgrammar as xgr

        self.grammar = grammar
        self.matcher = xgr.GrammarMatcher(grammar.compiled)  # unlimited rollback
        self.bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)
        self.shifts = torch.arange(32, dtype=torch.int32)
        self.stop_mask = torch.zeros(grammar.vocab_size, dtype=torch.bool)
        self.stop_mask[grammar.stop_ids] = True

    def mask(self) -> Tensor:
        """bool [V]: True for the tokens the grammar allows next (never empty). After the stop token was
        accepted the row is over; the stop tokens stay allowed so that positions drafted past it (never
        committed) still have a distribution."""
        if self.matcher.is_terminated():
            return self.stop_mask.clone()
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = (self.bitmask[0, :, None] >> self.shifts) & 1  # [V/32, 32], bit j of word i = token 32 i + j
        return bits.flatten()[: self.grammar.vocab_size].bool()

    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it here."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, n: int) -> None:
        if n > 0:
            self.matcher.rollback(n)

    @property
    def complete(self) -> bool:
        """The tokens accepted so far form a whole sentence of the grammar (ended by a stop token or not)."""
        return bool(self.matcher.is_completed())


def row_masks(constraints: list[TokenConstraint | None], vocab_size: int, device=None) -> Tensor | None:
    """[B, V] masks of each row's constraint (all-True for unconstrained rows), or None when no row has one."""
    if all(c is None for c in constraints):
        return None
    full = torch.ones(vocab_size, dtype=torch.bool)
    return torch.stack([full if c is None else c.mask() for c in constraints]).to(device)


def chain_masks(constraint: TokenConstraint, drafts: list[int], deterministic: bool) -> tuple[Tensor, int]:
    """Masks [len(drafts) + 1, V] for the target's distributions after each prefix of a drafted chain.

    The matcher advances through the drafts and is rolled back to where it started. A draft the grammar does
    not allow has target probability 0, so it is always rejected and the positions after it are never used
    (they get all-True masks). Deterministic drafts (n-gram, Medusa: q = one-hot) are cut at the first such
    draft, which leaves the output unchanged (the residual of a one-hot q with p(x) = 0 is p itself); drafts
    sampled from a distribution q are kept (cutting them would bias the output unless q was masked). Returns
    (masks, usable drafts)."""
    V = constraint.grammar.vocab_size
    masks = torch.ones(len(drafts) + 1, V, dtype=torch.bool)
    advanced, usable = 0, len(drafts)
    for j, tok in enumerate(drafts):
        masks[j] = constraint.mask()
        if not (bool(masks[j, tok]) and constraint.accept(tok)):
            usable = j if deterministic else usable
            break
        advanced += 1
    else:
        masks[len(drafts)] = constraint.mask()
    constraint.rollback(advanced)
    return masks, usable


def tree_masks(constraint: TokenConstraint, node_tokens: list[int], parents: list[int]) -> Tensor:
    """Masks [N, V] for the target's distributions after each node's path of a candidate tree (node 0 = the
    root, the last committed token). Below a node the grammar refuses the masks are all-True: the target
    gives that node probability 0, so nothing under it is ever accepted. The matcher ends where it began."""
    V = constraint.grammar.vocab_size
    masks = torch.ones(len(node_tokens), V, dtype=torch.bool)
    paths: list[list[int]] = [[]]
    for i in range(1, len(node_tokens)):
        paths.append(paths[parents[i]] + [i])
    for i, path in enumerate(paths):
        advanced = 0
        for node in path:
            if not constraint.accept(node_tokens[node]):
                break
            advanced += 1
        if advanced == len(path):
            masks[i] = constraint.mask()
        constraint.rollback(advanced)
    return masks


def mask_logits(logits: Tensor, mask: Tensor | None) -> Tensor:
    """[..., V] logits with the tokens a grammar refuses at -inf (what logits_to_probs(mask=) does), so any
    consumer of logits (the verifier, greedy argmax, top-k/top-p) sees the constrained distribution."""
    if mask is None:
        return logits
    return logits.float().masked_fill(~mask.to(logits.device), float("-inf"))


def row_constraints(grammar: Grammar | list[Grammar | None] | None, params: list, vocab_size: int) -> list:
    """One fresh matcher per row (None for unconstrained rows) after checking each grammar fits the model
    and the row's params (a grammar ends the output with EOS, so ignore_eos cannot apply)."""
    grammars = grammar if isinstance(grammar, list) else [grammar] * len(params)
    if len(grammars) != len(params):
        raise ValueError(f"{len(grammars)} grammars for {len(params)} prompts")
    for g, p in zip(grammars, params):
        if g is not None and g.vocab_size != vocab_size:
            raise ValueError(f"the grammar was compiled for {g.vocab_size} tokens, the model has {vocab_size}")
        if g is not None and p.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar: the grammar ends the output with EOS")
    return [None if g is None else g.matcher() for g in grammars]


def response_format_spec(value) -> GrammarSpec | None:
    """OpenAI ``response_format`` -> GrammarSpec: {"type": "text"} (none), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise GrammarError("'response_format' must be an object with a string 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise GrammarError("'response_format.json_schema.schema' must be a JSON schema object")
        return GrammarSpec("json_schema", json.dumps(schema))
    raise GrammarError(f"'response_format.type' {kind!r} is not supported; use text, json_object or json_schema")


class ResponseFormats:
    """The server's response_format -> compiled Grammar, keeping the last few compiled grammars."""

    def __init__(self, tokenizer, config, keep: int = 64):
        self.tokenizer, self.config, self.keep = tokenizer, config, keep
        self.cache: dict[GrammarSpec, Grammar] = {}

    def parse(self, body: dict) -> Grammar | None:
        spec = response_format_spec(body.get("response_format"))
        if spec is None:
            return None
        if spec not in self.cache:
            if len(self.cache) >= self.keep:
                self.cache.pop(next(iter(self.cache)))
            self.cache[spec] = Grammar(spec, self.tokenizer, self.config.vocab_size, self.config.eos_token_ids)
        return self.cache[spec]


def report_incomplete(incomplete: list[bool], finish_reasons: list[str]) -> None:
    """One stderr line per output that stopped before its grammar was satisfied (not valid under it)."""
    for i, (bad, reason) in enumerate(zip(incomplete, finish_reasons)):
        if bad:
            print(
                f"[qspec] output {i} is INCOMPLETE: it stopped ({reason}) before the grammar was satisfied, so it is "
                "not valid under the grammar",
                file=sys.stderr,
            )


def cli_grammar(ap, args, tokenizer, config) -> Grammar | None:
    """The grammar of --json-schema / --json-object / --regex / --grammar (add_grammar_args), or None; bad
    input is an argparse error."""
    try:
        if args.json_schema:
            spec = GrammarSpec("json_schema", Path(args.json_schema).read_text())
        elif args.grammar:
            spec = GrammarSpec("ebnf", Path(args.grammar).read_text())
        elif args.regex:
            spec = GrammarSpec("regex", args.regex)
        elif args.json_object:
            spec = GrammarSpec("json_object")
        else:
            return None
        return Grammar(spec, tokenizer, config.vocab_size, config.eos_token_ids)
    except OSError as err:
        ap.error(f"cannot read the grammar file: {err}")
    except GrammarError as err:
        ap.error(str(err))


def add_grammar_args(ap) -> None:
    constrain = ap.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON matching this schema")
    constrain.add_argument("--json-object", action="store_true", help="constrain the output to any JSON object")
    constrain.add_argument("--regex", metavar="PATTERN", help="constrain the output to this regular expression")
    constrain.add_argument("--grammar", metavar="FILE", help="constrain the output to this EBNF grammar (root ::= ...)")
