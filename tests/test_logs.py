"""--log-level: one format with the peer's name, the chosen level, and records still reach other handlers."""

import logging

import pytest

from peer import logs


def test_configured_lines_carry_level_peer_and_module_and_honour_the_level(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("info")
    logs.set_peer_name("stage1-0")
    logging.getLogger("swarm.outer.replica").info("a strike against 12D3…")
    logging.getLogger("swarm.pipeline.trainer").debug("not shown at info")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith("INFO    [stage1-0] swarm.outer.replica: a strike against 12D3…"), err
    logs.configure("warning")
    logging.getLogger("optim.outer").info("hidden")
    assert capsys.readouterr().err == "" and logs.current_level() == "warning"
    with pytest.raises(ValueError, match="log level must be one of"):
        logs.configure("loud")  # type: ignore[arg-type]  # a wrong value, on purpose


def test_records_still_reach_the_root_handlers_once_configured(caplog: pytest.LogCaptureFixture) -> None:
    # the CLI configures logging in-process (typer's CliRunner in other tests): warnings that tests assert on
    # through caplog, e.g. a dropped pseudo-gradient, must still arrive there
    logs.configure("info")
    with caplog.at_level(logging.WARNING):
        logging.getLogger("optim.outer").warning("outer round 3: dropped a pseudo-gradient")
    assert "dropped a pseudo-gradient" in caplog.text
