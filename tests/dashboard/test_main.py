"""`gpu-dra dashboard` refuses bad settings before anything starts."""

import pytest

from services.dashboard.main import main


def test_bad_settings_stop_the_dashboard_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--listen", "8765"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    assert main(["--trace-url-template", "http://ui/trace/"]) == 2
    assert "{traceId}" in capsys.readouterr().err
    assert main(["--auth", "ldap"]) == 2
