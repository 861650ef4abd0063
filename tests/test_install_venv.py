"""tools/install_venv.py: pip's configuration, as `pip config list` prints it, becomes uv's options.
(The install itself runs in every fresh clone's `make test`.)"""
from __future__ import annotations

import subprocess
import sys

from tools.install_venv import pip_config, uv_options

LISTING = """:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/somewhere/else'
install.no-index='false'
"""


def test_pips_listing_becomes_uvs_options_the_environment_winning_over_files():
    conf = pip_config(LISTING)
    assert conf["find-links"] == "/opt/wheels"  # PIP_FIND_LINKS over the file's
    args, env = uv_options(conf)
    pairs = list(zip(args[::2], args[1::2]))
    assert ("--index-strategy", "unsafe-best-match") in pairs
    assert ("--find-links", "/opt/wheels") in pairs and ("--find-links", "/somewhere/else") not in pairs
    assert [v for f, v in pairs if f == "--extra-index-url"] == ["file:///opt/pypi/simple",
                                                                 "file:///opt/pypi-more/simple"]
    assert ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs and "--no-index" not in args
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}


def test_no_index_and_an_empty_configuration():
    assert "--no-index" in uv_options(pip_config("global.no-index='true'\n"))[0]
    assert uv_options(pip_config("")) == (["--index-strategy", "unsafe-best-match"], {})


def test_this_machines_own_pip_configuration_parses():
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    conf = pip_config(listing)
    assert len(conf) == len({line.split("=")[0].rsplit(".", 1)[-1] for line in listing.splitlines() if "=" in line})
    uv_options(conf)


def test_a_line_pip_config_never_prints_is_an_error_the_installer_falls_back_on():
    import pytest

    with pytest.raises((ValueError, SyntaxError)):
        pip_config("global.find-links=/opt/wheels\n")  # unquoted: not what pip prints
