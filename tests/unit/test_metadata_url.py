"""A misspelled metadata URL fails at once, with the URL parser's message, wherever it is given."""
from __future__ import annotations

import time

import pytest

from kvstore.metadata import check_metadata_url, open_metadata

BAD = ["etc://127.0.0.1:2379", "etcd://127.0.0.1", "etcd://127.0.0.1:port", "etcd://h:1?nope=1", "http://h:1"]


@pytest.mark.parametrize("url", BAD)
def test_check_gives_the_message_open_gives(url):
    """Kills: a check that accepts what open_metadata refuses, or says something else."""
    with pytest.raises(ValueError) as opened:
        open_metadata(url)
    with pytest.raises(ValueError) as checked:
        check_metadata_url(url)
    assert str(checked.value) == str(opened.value) and url in str(checked.value)


@pytest.mark.parametrize("url", ["memory://x", "etcd://127.0.0.1:2379", "etcd+tls://h:1?ca=a.pem"])
def test_check_accepts_good_urls_without_connecting(url):
    check_metadata_url(url)


def test_client_with_a_misspelled_scheme_fails_at_once():
    """Kills: the client waiting its whole timeout (5 s) for a mirror that can never load, then
    saying 'could not load a snapshot' instead of what is wrong with the URL."""
    from kvstore import Client

    started = time.monotonic()
    with pytest.raises(ValueError, match="unknown metadata URL 'etc://127.0.0.1:2379'"):
        Client("etc://127.0.0.1:2379", timeout=5.0)
    assert time.monotonic() - started < 1.0
