"""``alignpipe completion bash|zsh``: a shell completion script, generated from the parser.

``eval "$(alignpipe completion bash)"`` (or ``zsh``, through its bash compatibility) in a
shell's rc file completes the commands, their subcommands and choices, and every flag of
the command typed; paths complete as files. The script lists what this installed version
has, so it is written again after an upgrade, not kept in the repository.
"""

from __future__ import annotations

import argparse
import sys


def add_completion(parser: argparse.ArgumentParser) -> None:
    """``alignpipe completion SHELL``."""
    parser.add_argument("shell", choices=("bash", "zsh"), help="the shell to complete in")
    parser.set_defaults(handler=_completion)


def _completion(args: argparse.Namespace, rest: list[str]) -> int:
    # The top-level parser, which cli/main.py hands every command (no import back to it).
    sys.stdout.write(script(args.root_parser, args.shell))
    return 0


def _words(parser: argparse.ArgumentParser) -> list[str]:
    """A command's flags, its subcommands and its positional choices."""
    words = []
    for action in parser._actions:  # argparse keeps no public list of a parser's arguments
        if action.help == argparse.SUPPRESS and not action.option_strings:
            words += list(getattr(action, "choices", None) or ())  # hidden subcommands
            continue
        if action.help == argparse.SUPPRESS:
            continue
        words += [o for o in action.option_strings if o.startswith("--")]
        if not action.option_strings and action.choices:
            words += [str(choice) for choice in action.choices]
    return sorted(set(words))


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``parser``'s commands for ``shell``."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    cases = []
    for name, sub in commands.items():
        words = _words(sub)
        for action in sub._actions:  # a command's own subcommands (data shard, model export)
            if isinstance(action, argparse._SubParsersAction):
                for inner, inner_parser in action.choices.items():
                    inner_words = " ".join(_words(inner_parser))
                    cases.append(f'    "{name} {inner}") words="{inner_words}";;')
        cases.append(f'    "{name} "*) words="{" ".join(words)}";;')
    prelude = "autoload -U +X bashcompinit && bashcompinit\n" if shell == "zsh" else ""
    return (
        f'# alignpipe {shell} completion: eval "$(alignpipe completion {shell})"\n{prelude}'
        "_alignpipe() {\n"
        '  local cur="${COMP_WORDS[COMP_CWORD]}" words\n'
        '  if [ "$COMP_CWORD" -eq 1 ]; then\n'
        f'    COMPREPLY=($(compgen -W "{" ".join(commands)} --help --version" -- "$cur"))\n'
        "    return\n"
        "  fi\n"
        '  case "${COMP_WORDS[1]} ${COMP_WORDS[2]}" in\n' + "\n".join(cases) + "\n  esac\n"
        '  COMPREPLY=($(compgen -W "$words" -- "$cur"))\n'
        "}\n"
        "complete -o default -F _alignpipe alignpipe\n"
    )
