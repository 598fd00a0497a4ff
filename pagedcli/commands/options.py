"""The options more than one command takes, as Typer flags: the engine's (EngineFlags) and the
requests' and their sampling (RequestFlags). The engine's and the sampling options are declared once,
in core/options.py (EngineOptions, SamplingParams): their flags are made from those fields here.
What only the command line has (where prompts come from, --chat, --n) is declared here. `flag_group`
adds a group's fields to a command's options and hands them to the command as one object."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

from pagedcli.core.errors import UsageError, name_settings
from pagedcli.core.options import MAX_N, EngineOptions, SamplingParams, declared
from pagedcli.model.presets import RANDOM_PRESETS

# what a flag's help adds to its declaration's, where the command line knows more
EXTRA_HELP = {"model": f" Presets (public checkpoints' shapes): {' · '.join(RANDOM_PRESETS)}."}


def typer_option(field: dataclasses.Field, annotation, default=dataclasses.MISSING):
    """(name, Annotated[type, typer.Option], default) of a declared option, as a flag group's field."""
    help_text = field.metadata["help"] + EXTRA_HELP.get(field.name, "")
    info = typer.Option(*field.metadata["flags"], help=help_text, show_default=default is not None)
    default = field.default if default is dataclasses.MISSING else default
    return field.name, Annotated[annotation, info], dataclasses.field(default=default)


class _EngineFlags:
    def options(self, **overrides) -> EngineOptions:
        """The EngineOptions these flags ask for (`overrides`: what the command decides itself)."""
        return EngineOptions(**(dataclasses.asdict(self) | overrides))


_ENGINE_HINTS = typing.get_type_hints(EngineOptions)
# EngineOptions' fields the command line sets, with their declared types, defaults and help
EngineFlags = dataclasses.make_dataclass("EngineFlags", [
    typer_option(f, _ENGINE_HINTS[f.name]) for f in declared(EngineOptions) if f.metadata["cli"]], bases=(_EngineFlags,))
EngineFlags.__module__ = __name__  # (where pickle finds it: serve sends the flags to its engine process)


def given_path(text: str) -> Path:
    """A file option's value as a Path: an empty one is a mistake (Path('') is the folder `.`)."""
    if not text:
        raise typer.BadParameter("'' names no file")
    return Path(text)


class _RequestFlags:
    def sampling(self) -> dict:
        """The sampling options as given (None: not given)."""
        given = {name: getattr(self, name) for name in SAMPLING_FLAGS}
        given["stop"] = tuple(self.stop) if self.stop else None
        given["structured"] = self.structured()
        return given

    def structured(self) -> tuple[str, str] | None:
        """--json-schema, --regex, --choice or --grammar as SamplingParams.structured (one at most)."""
        from pagedcli.model.files import read_given_text

        given = [flag for flag, value in (("--json-schema", self.json_schema), ("--regex", self.regex),
                                          ("--choice", self.choice), ("--grammar", self.grammar)) if value]
        if len(given) > 1:
            raise UsageError(f"{given[0]} and {given[1]} both constrain the answer", "give one of them")
        if self.json_schema is not None:
            text = read_given_text(self.json_schema, f"--json-schema {self.json_schema}", "give a JSON schema file")
            try:
                json.loads(text)
            except ValueError as e:
                raise UsageError(f"--json-schema {self.json_schema}: not JSON ({e})", "give a JSON schema file") from None
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice:
            return "choice", json.dumps(list(self.choice))
        if self.grammar is not None:
            return "grammar", read_given_text(self.grammar, f"--grammar {self.grammar}",
                                              "give an EBNF / GBNF grammar file")
        return None


_SAMPLING_HINTS = typing.get_type_hints(SamplingParams)
# The flags of SamplingParams' fields: each None (not given) by default, so that the model's
# generation_config.json fills in what the user leaves out, but for those whose declared default
# stands as the flag's; --stop is repeatable (a list), --logprobs a count.
FLAG_DEFAULTS_AS_DECLARED = ("max_tokens", "ignore_eos")
SAMPLING_FLAGS = [f.name for f in declared(SamplingParams) if f.metadata["cli"]]


def _sampling_flag(field: dataclasses.Field):
    if field.name in FLAG_DEFAULTS_AS_DECLARED:
        return typer_option(field, _SAMPLING_HINTS[field.name])
    annotation = Optional[list[str]] if field.name == "stop" else Optional[_SAMPLING_HINTS[field.name]]
    return typer_option(field, annotation, default=None)


RequestFlags = dataclasses.make_dataclass("RequestFlags", [
    ("prompts", Annotated[Optional[list[str]], typer.Argument(
        help="Prompts; several run together. `-`: read them from standard input, as with none and input piped in.",
        show_default=False)], dataclasses.field(default=None)),
    ("prompt_file", Annotated[Optional[Path], typer.Option(
        help="A UTF-8 file with one prompt per line (`-`: standard input).", parser=given_path)],
     dataclasses.field(default=None)),
    ("prompt_separator", Annotated[str, typer.Option(
        help=r"What ends a prompt in a prompt file or standard input, with \n, \t, \r and \\ read as escapes: "
        r"'\n\n' for prompts of several lines between blank lines, '' for the whole input as one prompt.")],
     dataclasses.field(default=r"\n")),
    ("chat", Annotated[Optional[bool], typer.Option(
        "--chat/--raw", help="Wrap prompts in the model's chat template (default when it has one) or feed them as is.")],
     dataclasses.field(default=None)),
    ("system", Annotated[Optional[str], typer.Option(help="A system message before each prompt, in the chat template.",
                                                     show_default=False)], dataclasses.field(default=None)),
    ("chat_template", Annotated[Optional[Path], typer.Option(
        help="A Jinja chat template file (as vLLM's --chat-template), in place of the model folder's.",
        show_default=False, parser=given_path)], dataclasses.field(default=None)),
    ("chat_template_kwargs", Annotated[Optional[str], typer.Option(
        help="More variables for the chat template, a JSON object (as vLLM's chat_template_kwargs), e.g. "
        "'{\"enable_thinking\": false}' for Qwen3 to answer without thinking first. serve: each request's "
        "chat_template_kwargs go over these.", show_default=False)], dataclasses.field(default=None)),
    *(_sampling_flag(f) for f in declared(SamplingParams) if f.metadata["cli"]),
    ("samples", Annotated[int, typer.Option("--n", help=f"Answers per prompt (1 to {MAX_N}); they share the prompt's "
                                            "blocks (copy-on-write).")], dataclasses.field(default=1)),
    # the answer held to a grammar (engine/structured.py): one of these
    ("json_schema", Annotated[Optional[Path], typer.Option(
        help="Hold the answer to this JSON schema (a file): it parses and validates.", show_default=False)],
     dataclasses.field(default=None)),
    ("regex", Annotated[Optional[str], typer.Option(help="Hold the answer to this regular expression.",
                                                    show_default=False)], dataclasses.field(default=None)),
    ("choice", Annotated[Optional[list[str]], typer.Option(help="The answer is one of these texts (repeatable).",
                                                           show_default=False)], dataclasses.field(default=None)),
    ("grammar", Annotated[Optional[Path], typer.Option(
        help="Hold the answer to this grammar (a file, EBNF as GBNF or xgrammar writes it).", show_default=False)],
     dataclasses.field(default=None)),
], bases=(_RequestFlags,))
RequestFlags.__module__ = __name__


def flag_group(group: type, param: str, leave_out: dict | None = None, first: bool = False):
    """Give a command the fields of `group` (a dataclass of Typer options) as its own options, and
    the values as one `group` object in its parameter `param`. `leave_out`: fields the command does
    not offer, with the value they take; `first`: list them before the command's own options."""
    leave_out = leave_out or {}
    hints = typing.get_type_hints(group, include_extras=True)
    fields = [f for f in dataclasses.fields(group) if f.name not in leave_out]
    added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
             for f in fields]

    def decorate(command):
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != param]

        @functools.wraps(command)
        def wrapper(**kwargs):
            values = {f.name: kwargs.pop(f.name) for f in fields}
            return command(**kwargs, **{param: group(**values, **leave_out)})

        params = added + own if first else own + added
        wrapper.__signature__ = inspect.Signature(params)  # what Typer reads the options from
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


def _flags() -> dict[str, str]:
    """Each setting's flag, by the field name core messages give it (pagedcli.core.errors.name_settings)."""
    flags = {"raw": "--raw"}  # the off side of --chat/--raw
    for group in (EngineFlags, RequestFlags):
        for name, hint in typing.get_type_hints(group, include_extras=True).items():
            info = hint.__metadata__[0]  # in Annotated, an Option's first name is its `default`
            decls = [d for d in (info.default, *(info.param_decls or ())) if isinstance(d, str) and d.startswith("--")]
            flags[name] = decls[0].split("/")[0] if decls else "--" + name.replace("_", "-")
    return flags


FLAGS = _flags()


def with_flags(text: str) -> str:
    """A core message as the command line shows it: each setting named by its flag."""
    return name_settings(text, FLAGS)
