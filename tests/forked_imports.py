"""Python snippets, each in a child forked from one interpreter that has imported only some heavy
third-party modules (MindSpore: ~4 s a process) and nothing of this checkout: each child imports this
checkout's modules afresh, in the order its snippet does, as ``python -c SNIPPET`` would after the
same third-party imports, and the heavy import is paid once for all of them.

``run_forked(snippets, preload, cwd)`` runs this file as a script: it reads the snippets as JSON on
stdin and writes, per snippet, [exit status, the child's stdout and stderr] as JSON on stdout."""
import json
import os
import subprocess
import sys
import tempfile
import traceback


def run_forked(snippets: list[str], preload: list[str], cwd) -> list[tuple[int, str]]:
    """Per snippet, (exit status, output) of a child forked after ``import *preload`` in a fresh
    interpreter started in ``cwd`` (which is on sys.path, as for ``python -c``)."""
    run = subprocess.run([sys.executable, __file__, *preload], input=json.dumps(snippets), capture_output=True,
                         text=True, cwd=cwd, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [tuple(result) for result in json.loads(run.stdout)]


def _run_in_child(snippet: str, output) -> int:
    """Forks; the child runs ``snippet`` as ``__main__`` with its stdout and stderr in ``output``."""
    pid = os.fork()
    if pid == 0:
        sys.argv = ["-c"]
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
        status = 0
        try:
            exec(compile(snippet, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as stop:  # the status python -c would exit with
            status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except BaseException:  # a failing snippet's traceback, as python -c prints it
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def main() -> None:
    sys.path[0] = ""  # the working directory, not this file's folder: as for python -c
    for module in sys.argv[1:]:
        __import__(module)
    results = []
    for snippet in json.load(sys.stdin):
        with tempfile.TemporaryFile("w+") as output:
            status = _run_in_child(snippet, output)
            output.seek(0)
            results.append((status, output.read()))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
