"""launcher/backends/wheelhouse.py: pinned wheels fetched once with pip, checked by sha256, cached by content."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import zipfile

import pytest

from launcher.backends.wheelhouse import ensure, job_wheels, pinned, wheelhouse_key
from launcher.errors import LauncherError


def test_the_torchao_pin_is_an_abi3_wheel_for_the_default_images_platform():
    wheel = pinned("torchao")
    assert wheel.requirement == "torchao==0.18.0"
    assert wheel.file.startswith("torchao-0.18.0-cp310-abi3-") and "manylinux_2_28_x86_64" in wheel.file
    assert (wheel.platform, wheel.python) == ("manylinux_2_28_x86_64", "3.12")


def test_only_fp8_jobs_need_the_wheel():
    assert job_wheels({"precision": {"fp8": True}}) == (pinned("torchao"),)
    assert job_wheels({"precision": {"fp8": False}}) == ()


def test_the_wheelhouse_key_is_a_content_address_of_its_wheels():
    wheel = pinned("torchao")
    other = dataclasses.replace(wheel, sha256="0" * 64)
    assert wheelhouse_key((wheel,)) == wheelhouse_key((wheel,))
    assert wheelhouse_key((wheel,)) != wheelhouse_key((other,))
    assert len(wheelhouse_key((wheel,))) == 64


def test_the_real_wheel_is_fetched_once_and_matches_its_pin(torchao_wheel, shared_wheel_cache, monkeypatch):
    wheel = pinned("torchao")
    assert torchao_wheel == shared_wheel_cache / wheel.sha256 / wheel.file
    assert hashlib.sha256(torchao_wheel.read_bytes()).hexdigest() == wheel.sha256
    assert 3_000_000 < torchao_wheel.stat().st_size < 4_000_000  # about 3.4 MB
    with zipfile.ZipFile(torchao_wheel) as archive:
        assert "torchao/__init__.py" in archive.namelist()

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran although the wheel is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert ensure(wheel) == torchao_wheel


def test_a_corrupted_cache_entry_is_fetched_again(torchao_wheel, monkeypatch, tmp_path):
    monkeypatch.setenv("LAUNCHER_WHEEL_CACHE", str(tmp_path / "cache"))
    wheel = pinned("torchao")
    broken = tmp_path / "cache" / wheel.sha256 / wheel.file
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"half a download")
    assert ensure(wheel).read_bytes() == torchao_wheel.read_bytes()


def test_a_wheel_whose_bytes_differ_from_the_pin_is_refused(torchao_wheel, monkeypatch, tmp_path):
    monkeypatch.setenv("LAUNCHER_WHEEL_CACHE", str(tmp_path / "cache"))
    wrong = dataclasses.replace(pinned("torchao"), sha256="ab" * 32)
    with pytest.raises(LauncherError) as error:
        ensure(wrong)
    assert str(error.value) == (
        f"{wrong.file} from pip has sha256 {pinned('torchao').sha256}, not the pinned {'ab' * 32} "
        "(launcher/backends/dlc_images.yaml); refusing to ship it"
    )
    assert not (tmp_path / "cache" / wrong.sha256).exists()


def test_a_pin_pip_cannot_fetch_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setenv("LAUNCHER_WHEEL_CACHE", str(tmp_path / "cache"))
    missing = dataclasses.replace(pinned("torchao"), version="0.0.1.dev999", file="torchao-0.0.1.dev999-none.whl")
    with pytest.raises(LauncherError) as error:
        ensure(missing)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "cannot fetch torchao==0.0.1.dev999 (torchao-0.0.1.dev999-none.whl) for the job's wheelhouse: "
    )
    assert "(got nothing); FP8 jobs need it: check pip's access to the package index, or put the file in " in message
