"""What the pass-through sends upstream: the path exactly as the client wrote it, and what it
answers itself (`OPTIONS *`, which names no upstream path)."""

from __future__ import annotations

import socket

import httpx

from tests.conftest import Proxy


def test_the_raw_path_is_forwarded_not_the_decoded_one(proxy: Proxy, scripted_url: str) -> None:
    response = httpx.post(proxy.url + "/tokenize%2Fextra/a%20b", content=b"{}",
                          headers={"x-request-id": "raw-path"})
    assert response.status_code == 200
    log = httpx.get(scripted_url + "/_log/raw-path").json()
    assert log["raw_path"] == "/tokenize%2Fextra/a%20b"  # not /tokenize/extra/a b


def test_options_asterisk_is_answered_by_the_proxy(proxy: Proxy) -> None:
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"OPTIONS * HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 204"), answer
    assert b"allow: get, post, options" in head
