"""scripts/uv_pip.py: pip's settings passed on to uv as pip would apply them (uv reads no pip.conf), from
`pip config list` output like this machine's (a wheel folder, two extra indexes, a constraint, a certificate)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("uv_pip", ROOT / "scripts" / "uv_pip.py")
uv_pip = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_pip)

THIS_MACHINE = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
"""


def test_every_list_setting_is_kept_once_and_the_certificate_goes_to_ssl_cert_file():
    flags, env = uv_pip.uv_options(THIS_MACHINE, {})
    assert flags == [
        "--find-links", "/opt/wheels",  # the variable and pip.conf name the same folder: once
        "--constraint", "/etc/xdg/pip/constraints.txt",
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
    ]  # fmt: skip
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}
    assert uv_pip.uv_options(THIS_MACHINE, {"SSL_CERT_FILE": "/mine.pem"})[1] == {}  # a set variable is kept


def test_a_pip_index_url_variable_wins_over_the_files_and_nothing_set_passes_nothing():
    files = "global.index-url='https://mirror/simple'\nuser.find-links='a b'\n"
    assert uv_pip.uv_options(files, {})[0] == [
        "--find-links",
        "a",
        "--find-links",
        "b",
        "--index-url",
        "https://mirror/simple",
    ]
    both = files + ":env:.index-url='https://proxy/simple'\n"
    assert uv_pip.uv_options(both, {})[0][-2:] == ["--index-url", "https://proxy/simple"]
    assert uv_pip.uv_options("", {}) == ([], {})
    assert uv_pip.uv_options("global.timeout='60'\nno equals sign here\n", {}) == ([], {})
