"""The supervisor's signal handler writes nothing itself: a line written from a handler can land
inside the main thread's write to the same stream or log file, where Python raises "reentrant
call" and the launcher ends with exit 1 (a closed terminal once did exactly that). Its lines are
printed by the main thread instead."""

import io
import signal

from mfsdp_launch.launcher.output import Console
from mfsdp_launch.launcher.supervise import Supervisor


class _Reentrant(io.StringIO):
    """A stream whose write fails as a BufferedWriter's does when re-entered."""

    def write(self, text):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")


def test_the_handler_only_records_and_the_main_thread_prints(tmp_path, capsys):
    console = Console(tmp_path / "launcher.log")
    sup = Supervisor(["true"], {}, tmp_path, console)
    try:
        writes = []
        console.write = lambda text, stream, to_log=True: writes.append(text)  # noqa: E731
        sup._on_signal(signal.SIGHUP, None)
        assert writes == [] and sup.result.stop_requested and (tmp_path / "STOP").exists()
        sup._on_signal(signal.SIGHUP, None)  # again: abort (no torchrun yet: nothing to kill)
        assert writes == [] and sup.result.aborted
        sup.say_pending()
        assert [w.split(":")[1].strip() for w in writes] == ["SIGHUP", "SIGHUP again"]
        assert "finishing the step" in writes[0] and "aborting" in writes[1]
    finally:
        sup.restore_signals()
        console.close()


def test_a_stop_before_start_starts_nothing_and_says_why(tmp_path, capsys):
    console = Console(tmp_path / "launcher.log")
    sup = Supervisor(["false"], {}, tmp_path, console)
    try:
        sup._on_signal(signal.SIGTERM, None)
        result = sup.run()
        assert result.rc == 0 and result.stop_requested and sup.proc is None
    finally:
        sup.restore_signals()
        console.close()
    assert "SIGTERM: finishing the step" in capsys.readouterr().err
    assert "SIGTERM: finishing the step" in (tmp_path / "launcher.log").read_text()


def test_a_reentrant_write_loses_one_terminal_line_not_the_launcher(tmp_path):
    console = Console(tmp_path / "launcher.log")
    console.write("mfsdp-train: SIGHUP: stopping\n", _Reentrant())
    console.close()
    assert (tmp_path / "launcher.log").read_text() == "mfsdp-train: SIGHUP: stopping\n"
