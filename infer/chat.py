"""A multi-turn conversation in the terminal, each answer streamed as it is decoded.

    s2d chat --target smollm2 --draft smollm2-draft
    s2d chat --target smollm2 --method ar --script turns.txt --out-file answers.jsonl

Type a message and press Enter (arrow keys edit the line and recall earlier ones); commands:
/reset (forget the conversation), /stats (this conversation's totals), /help, /quit (or
Ctrl-D). Ctrl-C while an answer streams stops it and keeps the conversation (with the part
shown); Ctrl-C at the prompt, twice, ends the chat. --script FILE reads the turns (and
commands) from a file instead, one per line; --out-file FILE also writes one JSON line per
answered turn. Each turn re-encodes the whole conversation in
the tokenizer's chat template (the engine keeps no K/V between generations; see
s2d_jax/decode/chat.py), padded to a width the turns share (512 tokens, then powers of
two), so the second turn runs the first one's compiled programs; a statistics line
follows each answer on stderr.
"""

from __future__ import annotations

import json
import sys

from s2d_jax.cli.args import (ArgumentParser, add_input, check_at_least,
                        check_sampling, parse_floats,
                        parse_ints)
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main

from s2d_jax.decode.methods import METHODS, proposer
CMD = "chat"  # its s2d subcommand: the name its shared flags are defined for
COMMANDS = {"/reset": "forget the conversation", "/stats": "this conversation's totals",
            "/help": "this list", "/quit": "end the session (also Ctrl-D)"}


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.chat", description=__doc__)
    add(ap, "--target", CMD, required=True)
    for name in ("--draft", "--method", "--exit", "--exits", "--thresholds", "--gamma",
                 "--chat-template"):
        add(ap, name, CMD)
    ap.add_argument("--system", default=None, help="a system message opening the "
                    "conversation (default: the template's own, if any)")
    for name in ("--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                 "--dtype"):
        add(ap, name, CMD)
    add_input(ap, "--script", default=None, metavar="FILE",
                    help="read the turns and commands from FILE, one per line, instead of "
                    "the terminal")
    add(ap, "--out-file", CMD)
    return ap.parse_args(argv)


def check_args(args) -> list[str] | None:
    """Every check that needs no model; returns the script's lines (None: interactive)."""
    from s2d_jax.decode.auto_method import cli_choice  # auto: the calibrated choice
    args.method, args.decoding, _ = cli_choice(args.method, [args.target],
                                               args.draft is not None)
    if proposer(args.decoding).needs_draft and args.draft is None:
        raise S2DError(f"method {args.decoding} needs --draft PATH (a draft model); pass one, "
                       f"or use --method ar")
    if proposer(args.decoding).self_draft and args.exit is None:
        raise S2DError(f"method {args.decoding} needs --exit (how many target layers draft)")
    check_sampling(args.temperature, args.top_p, args.top_k)
    check_at_least(args, {"max_new_tokens": 1, "gamma": 1, "exit": 1})
    if args.script is None:
        return None
    from s2d_jax.readers import read_text
    lines = [x.strip() for x in read_text(args.script, "--script file").splitlines()]
    lines = [x for x in lines if x]
    if not lines:
        raise S2DError(f"--script file {args.script} holds no turns; write one per line")
    return lines


def open_chat(args):
    from s2d_jax.decode.chat import Chat

    return Chat(args.target, args.draft, method=args.method, chat_template=args.chat_template,
                system=args.system, gamma=args.gamma, exit=args.exit,
                thresholds=(parse_floats(args.thresholds, "--thresholds", nonempty=True)
                            if args.thresholds else None),
                exits=parse_ints(args.exits, "--exits", minimum=1) if args.exits else None,
                dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed)


def turns_from(script: list[str] | None):
    """The user's lines: the script's (echoed), or the terminal's until Ctrl-D."""
    if script is not None:
        for line in script:
            print(f"you> {line}", flush=True)
            yield line
        return
    if sys.stdin.isatty():
        import readline  # noqa: F401 (input() then edits lines and keeps their history)
    try:
        yield from _terminal_lines()
    except KeyboardInterrupt:
        # a second press that landed between the first one's note and the next prompt
        # (outside input()'s handler): the chat ends as on a second press at the prompt
        _end_on_interrupt()


def _end_on_interrupt() -> None:
    """The chat ends: one more press must not cut short writing --out-file."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print()


def _terminal_lines():
    """The terminal's non-empty lines until Ctrl-D or a second Ctrl-C in a row."""
    interrupted = False
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            if interrupted:  # a second Ctrl-C in a row at the prompt
                _end_on_interrupt()
                return
            interrupted = True
            print("\n(Ctrl-C again, or Ctrl-D, ends the chat)", file=sys.stderr, flush=True)
            continue
        except UnicodeDecodeError:
            line = "\udcff"  # stdin decodes strictly: the same note as below
        if line and not _is_text(line):
            print("that line holds bytes that are not UTF-8 text (is the terminal set to "
                  "another encoding?); type it again", file=sys.stderr, flush=True)
            continue
        if line:
            interrupted = False
            yield line


def _is_text(line: str) -> bool:
    """Whether a line read from the terminal is text: stdin under a C/POSIX locale keeps
    undecodable bytes as lone surrogates, which no tokenizer takes."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def run_session(chat, lines, scripted: bool) -> list[dict]:
    """Answer every turn, run every command; -> one row per answered turn."""
    rows, conversation = [], 1
    for line in lines:
        if line.startswith("/"):
            if line == "/quit":
                break
            if line == "/reset":
                chat.reset()
                conversation += 1
                print("(conversation cleared)", flush=True)
            elif line == "/stats":
                print(chat.summary(), flush=True)
            else:
                print(("" if line == "/help" else f"unknown command {line}; the commands:\n")
                      + "\n".join(f"{c}  {what}" for c, what in COMMANDS.items())
                      + "\n(anything else is your next message)", flush=True)
            continue
        shown = Shown(waiting=not scripted and sys.stdout.isatty())
        try:
            out = chat.say(line, on_text=shown)
        except S2DError as e:
            if scripted:
                raise
            print(f"\nerror: {e}; /reset starts a new conversation", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            if scripted:
                raise
            chat.keep(line, shown.text)
            print("\n[answer stopped; the conversation keeps the part shown]", file=sys.stderr,
                  flush=True)
            continue
        print(flush=True)
        print(f"[{out['summary']}]", file=sys.stderr, flush=True)
        rows.append({"conversation": conversation, "turn": len(chat.messages) // 2, "user": line,
                     "text": out["text"], "token_ids": out["token_ids"],
                     "prompt_tokens": len(out["prompt_ids"]), "stats": out["stats"]})
    return rows


class Shown:
    """on_text of a turn: prints each piece after "assistant> " and keeps what was shown. On
    a terminal a placeholder stands there until the first piece (the turn's compile and
    prefill take seconds)."""

    WAIT = "(compiling and reading the conversation...)"

    def __init__(self, waiting: bool):
        self.text, self.waiting = "", waiting
        print("assistant> " + (self.WAIT if waiting else ""), end="", flush=True)

    def __call__(self, piece: str) -> None:
        if self.waiting:  # back to the line's start, clear it, write the prompt again
            print("\r\033[K" + "assistant> ", end="")
            self.waiting = False
        self.text += piece
        print(piece, end="", flush=True)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    script = check_args(args)
    print(f"loading {args.target} ...", file=sys.stderr, flush=True)
    chat = open_chat(args)
    for note in chat.notes:
        print(note, file=sys.stderr)
    if script is None:
        print("type a message; /help lists the commands", file=sys.stderr)
    rows = run_session(chat, turns_from(script), scripted=script is not None)
    if args.out_file:
        from s2d_jax.io.atomic import write_atomic
        write_atomic(args.out_file, "".join(json.dumps(row) + "\n" for row in rows))
    return 0


if __name__ == "__main__":
    main()
