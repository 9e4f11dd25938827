"""The API process's own files: the hub key readable by its owner only."""

from __future__ import annotations


def test_the_hub_key_file_is_private_even_over_an_open_file(tmp_path):
    import os
    import stat

    from dist_infer.cli.serve_frontend import write_private

    path = tmp_path / "hub.key"
    path.write_text("old")
    path.chmod(0o644)
    write_private(str(path), "secret")
    assert path.read_text() == "secret" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
