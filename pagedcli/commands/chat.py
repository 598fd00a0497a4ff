"""`pagedcli chat`: a conversation through the model's chat template, streamed, kept as one sequence.

Each turn's prompt is the token ids of every turn before (their prompts, the answers as generated,
the end-of-turn tokens the template adds) followed by the new message's. So the prefix cache finds
the earlier turns' full blocks (a finished sequence's blocks stay cached until reused), and a turn
computes only its new tokens. Only the new text is tokenized: the template is rendered for the
conversation with and without the new message, and the difference encoded. The answer keeps the
ids the model generated (text re-tokenized need not give them back).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator

from rich.console import Console

from pagedcli.commands.exits import Terminated, err, friendly_errors, need_stdout, notice
from pagedcli.commands.generate import load_for_text, request_params, sampling_defaults, stream_answers
from pagedcli.commands.options import EngineFlags, RequestFlags, flag_group, with_flags
from pagedcli.console.prompts import check_text, stdin_is_terminal
from pagedcli.core.errors import RunError, UsageError

if TYPE_CHECKING:
    from pagedcli.core.options import SamplingParams
    from pagedcli.engine.engine import Engine
    from pagedcli.engine.sequence import Sequence
    from pagedcli.engine.snapshot import CacheSnapshot
    from pagedcli.model.tokenizer import Tokenizer

COMMANDS = {"/reset": "start a new conversation (the cached blocks stay, for whatever repeats)",
            "/cache": "the conversation's block table, as inspect-cache shows it",
            "/live": "watch the cache while the next answer is generated",
            "/exit": "end (so does Ctrl-D)"}


@dataclass(frozen=True)
class Turn:
    message: str
    messages: list[dict]  # the conversation with this message, as the template takes it
    text: str  # their rendering, ending with the assistant's header
    ids: list[int]  # the prompt
    extended: bool  # the ids start with the conversation's so far


class Conversation:
    """The messages so far and the token ids the engine has seen for them."""

    def __init__(self, tokenizer: Tokenizer, system: str | None = None):
        self.tokenizer = tokenizer
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.ids: list[int] = []  # prompt and answer of every turn so far
        self.text = ""  # the rendering of the last turn's prompt
        self.answer = ""  # the last turn's answer, as printed
        self.num_turns = 0

    def prompt(self, message: str) -> Turn:
        """The next turn's prompt: the conversation's ids, then the encoded rest of the rendering
        (the end of the last answer's turn, the new message, the assistant's header). A template
        whose rendering does not extend the last one (it renders earlier turns differently now)
        gets the whole conversation encoded again (`extended` False)."""
        messages = self.messages + [{"role": "user", "content": message}]
        text = self.tokenizer.render_chat(messages)
        rest = self._rest(text)
        if rest is None:
            return Turn(message, messages, text, self.tokenizer.encode_rendered(text), extended=not self.ids)
        return Turn(message, messages, text, self.ids + self.tokenizer.encode_rendered(rest), extended=True)

    def _rest(self, text: str) -> str | None:
        """What `text` adds after the last prompt and its answer, or None if it does not extend them."""
        if not text.startswith(self.text):
            return None
        after = text[len(self.text):]
        for shown in (self.answer, self.answer.strip()):  # templates may trim a message (Llama 3's do)
            if after.startswith(shown):
                return after[len(shown):]
        return None

    def add(self, turn: Turn, answer_ids: list[int], answer: str) -> None:
        """The turn is done: its prompt and answer are the conversation now."""
        self.messages = turn.messages + [{"role": "assistant", "content": answer}]
        self.ids = turn.ids + list(answer_ids)
        self.text, self.answer = turn.text, answer
        self.num_turns += 1


class Chat:
    """The loop: read a message or a command, answer it, say what the cache did."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, params: SamplingParams, conversation: Conversation,
                 interactive: bool):
        self.engine = engine
        self.tokenizer = tokenizer
        self.params = params
        self.conversation = conversation
        self.interactive = interactive
        self.live_next = False
        self.last_snapshot: CacheSnapshot | None = None  # the last turn's sequence before it finished
        self.last_slot: int | None = None
        self.console = Console(highlight=False)

    def run(self, lines: Iterator[str]) -> None:
        for line in lines:
            command = line.strip()
            if command.startswith("/"):
                if not self.command(command):
                    return
            elif command:
                self.turn(line)

    # --- commands -----------------------------------------------------------------------------
    def command(self, command: str) -> bool:
        """Carry out a command; False ends the chat."""
        if command in ("/exit", "/quit"):
            return False
        if command == "/reset":
            self.conversation.reset()
            self.last_snapshot = None
            notice("a new conversation")
        elif command == "/cache":
            self.show_cache()
        elif command == "/live":
            self.live_next = True
        elif command == "/help":
            for name, what in COMMANDS.items():
                notice(f"{name:<7} {what}")
        else:
            self.say_error(f"{command.split()[0]} is not a command", f"the commands: {', '.join(COMMANDS)}, /help")
        return True

    def show_cache(self) -> None:
        from pagedcli.commands.inspect_cache import render

        snap = self.last_snapshot
        if snap is None:
            notice("nothing to show yet: the conversation's blocks are shown after an answer of two tokens or more")
            return
        self.console.print(render(snap, snap.slot(self.last_slot), self.tokenizer.decode, other_layers=None))

    # --- a turn -------------------------------------------------------------------------------
    def turn(self, message: str) -> None:
        from pagedcli.commands.output import TextPrinter, answer_text

        engine, conversation = self.engine, self.conversation
        try:
            check_text(message, "the message")
            turn = conversation.prompt(message)
        except UsageError as e:  # it is not text
            self.say_error(e.message, e.hint, fatal=UsageError)
            return
        except RunError as e:  # the template failed on it (chat feeds no raw prompts: its own way out)
            self.say_error(e.message, "fix the template, or give another with --chat-template FILE", fatal=RunError)
            return
        number = conversation.num_turns + 1
        if not turn.extended:
            notice(f"turn {number}: the chat template renders the earlier turns differently now, so the whole "
                   "conversation was encoded again (the cache serves only what still matches)")
        if engine.scheduler.why_unrunnable(len(turn.ids)) is not None:
            # the longest sequence the engine runs: the length limit or the whole pool, as the scheduler counts
            limit = min(engine.cache.max_model_len, engine.cache.geometry.pool_tokens)
            self.say_error(f"turn {number}: the conversation would be {len(turn.ids):,} tokens with this message, "
                           f"and {limit - 1:,} is the most a prompt can be here",
                           self.restart_hint(number, self.room_hint()), fatal=RunError)
            return
        params = self.params if self.params.seed is None else replace(self.params, seed=self.params.seed + number - 1)
        sched = engine.scheduler
        prompt_before, cached_before = sched.prompt_tokens, sched.cached_prompt_tokens
        seq = engine.add_request(turn.ids, params, message)
        if seq.error:  # a token the model has no embedding for: every later turn would hold it too
            raise RunError(with_flags(seq.error))
        view = self.open_view()
        printer = TextPrinter(self.tokenizer, [seq], echo_prompt=False, out=view.out if view else None)
        self.last_snapshot = None
        stopped = False
        try:
            with view or contextlib.nullcontext():
                stream_answers(engine, printer, [seq], on_step=lambda out: self.on_step(out, seq, view))
        except KeyboardInterrupt as e:
            if isinstance(e, Terminated) or not self.interactive:
                raise
            stopped = True  # Ctrl-C ends the answer, not the chat
        if seq.error:
            self.say_error(f"turn {number}: {with_flags(seq.error)}", self.restart_hint(number), fatal=RunError)
            return
        answer = answer_text(seq, printer.decoders[seq.id])
        answer_ids = seq.output_token_ids
        if seq.stop_strings is not None and seq.stop_strings.cut is not None:
            # the tokens that completed the stop string were generated, but the answer ends before
            # it (vLLM's --stop): the conversation goes on from the text the user saw
            answer_ids = self.tokenizer.encode_rendered(answer)
        conversation.add(turn, answer_ids, answer)
        prompt, cached = sched.prompt_tokens - prompt_before, sched.cached_prompt_tokens - cached_before
        blocks = engine.cache.geometry.blocks_for(seq.num_cached)
        notice(f"turn {number}: {cached:,} of {prompt:,} prompt tokens from cached blocks, "
               f"{blocks:,} block{'s' * (blocks != 1)} a layer, {engine.cache.num_free_blocks:,} free"
               + (" (stopped)" if stopped else ""))
        if seq.finish_reason == "length" and len(seq.output_token_ids) < seq.params.max_tokens:
            notice(f"the conversation reached {len(seq):,} tokens, the most it can hold here: /reset starts a new one")

    def on_step(self, out, seq: Sequence, view) -> None:
        if view is not None:
            view.on_step(out)
        if not seq.is_finished and seq.slot is not None:  # the longest table it will have, so far
            self.last_snapshot, self.last_slot = self.engine.snapshot(), seq.slot

    def open_view(self):
        if not self.live_next:
            return None
        from pagedcli.console.live_view import open_live_view

        self.live_next = False
        view = open_live_view(self.engine, self.tokenizer.decode, json_output=False)
        if view is None:
            notice("/live: stdout is not a terminal, so no live view")
        return view

    def room_hint(self) -> str:
        """What can make room for a longer conversation: the engine's length limit is the least of
        the model's positions, what the pool holds and --max-model-len (engine/build.py build_engine), and
        only the last two can grow."""
        cache = self.engine.cache
        if cache.max_model_len == self.engine.runner.model.config.context_length:
            return "a shorter message can fit (the model's positions end there)"
        if cache.max_model_len == cache.geometry.pool_tokens:
            return "--cache-size or --num-blocks can make room"
        return "--max-model-len can make room"

    def restart_hint(self, number: int, more: str | None = None) -> str | None:
        """The way out of a turn that cannot run: /reset in a terminal (when there is a conversation
        to drop), or what else can make room."""
        reset = "/reset starts a new conversation" if self.interactive and number > 1 else None
        return "; ".join(h for h in (reset, more) if h) or None

    def say_error(self, message: str, hint: str | None, fatal: type | None = None) -> None:
        """In a terminal, one line and the chat goes on; from a script, `fatal` ends the run (the
        later lines were written for a conversation that did not happen)."""
        if fatal is not None and not self.interactive:
            raise fatal(message, hint)
        from rich.markup import escape

        err.print(f"[bold red]error:[/bold red] {escape(with_flags(message))}"
                  + (f" [dim]({escape(with_flags(hint))})[/dim]" if hint else ""), soft_wrap=True)


# --- input ----------------------------------------------------------------------------------------
def typed_lines(prompt: str = "> ") -> Iterator[str]:
    """Lines typed at a terminal, with line editing and history (readline). Ctrl-C clears the
    line; Ctrl-D ends."""
    try:
        import readline  # noqa: F401  (input() gains editing and history once it is imported)
    except ImportError:  # Windows: plain input()
        pass
    while True:
        try:
            yield input(prompt)
        except EOFError:
            print()
            return
        except KeyboardInterrupt as e:
            if isinstance(e, Terminated):
                raise
            print()


def piped_lines() -> Iterator[str]:
    """Standard input's lines, one message each (UTF-8; a byte-order mark at its start dropped)."""
    for number, raw in enumerate(sys.stdin.buffer if sys.stdin else (), 1):  # (None: closed)
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"standard input line {number}: not UTF-8 text (byte {e.start})") from None
        yield line.removesuffix("\n").removesuffix("\r")


@friendly_errors
@flag_group(RequestFlags, "requests", first=True,
            leave_out={"prompts": None, "prompt_file": None, "prompt_separator": "\\n", "chat": True, "samples": 1,
                       "logprobs": None})
@flag_group(EngineFlags, "engine_flags", leave_out={"batch": 1})
def chat(*, requests: RequestFlags, engine_flags: EngineFlags):
    """Chat with the model through its chat template (or --chat-template), answers streamed.

    The conversation stays one sequence: each turn's prompt begins with the earlier turns' tokens, which the prefix cache serves, so a turn computes only its new tokens; a line on stderr says how many after each answer. Commands: /reset, /cache, /live, /exit (or Ctrl-D), /help.

    From a pipe (stdin not a terminal) each line is one message, and stdout gets only the answers, one per message, each ending in a newline (an answer may hold line breaks of its own), and what /cache shows; the cache lines go to stderr. A turn that cannot run then ends the run (exit 1).
    """
    need_stdout()
    params, given = request_params(requests)
    interactive = stdin_is_terminal()
    loaded = load_for_text(engine_flags, requests, "chat", True)
    params = sampling_defaults(params, loaded.source.generation_config, given,
                               f"{loaded.source.name}'s generation_config.json")
    conversation = Conversation(loaded.tokenizer, requests.system)
    session = Chat(loaded.engine, loaded.tokenizer, params, conversation, interactive)
    if interactive:
        notice(f"chatting with {loaded.source.name}: /reset starts over, /cache shows the conversation's blocks, "
               "/live watches the next answer, /exit or Ctrl-D ends")
    session.run(typed_lines() if interactive else piped_lines())
