"""``python -m tritonguard.llm``: bad arguments are one line and exit 2, before anything starts."""

from __future__ import annotations

import pytest

from tritonguard.llm.__main__ import EXIT_BAD_INPUT, main


@pytest.mark.parametrize(("argv", "why"), [
    (["--server", "localhost", "--model", "g"], "--server must be HOST:PORT"),
    (["--server", "127.0.0.1:8001", "--model", "g", "--port", "70000"], "--port must lie in"),
    (["--server", "127.0.0.1:8001", "--model", "g", "--model", "g"], "each guard once"),
    (["--server", "127.0.0.1:8001", "--model", "g", "--keys-file", "/no/such/keys.json"], "no such file"),
])
def test_bad_arguments_exit_2_with_one_line(argv, why, capsys):
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and why in err and err.count("\n") == 1


def test_a_tokenizer_folder_without_a_template_is_refused(tmp_path, capsys):
    assert main(["--server", "127.0.0.1:8001", "--model", "g", "--tokenizer", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "neither a chat template" in capsys.readouterr().err
