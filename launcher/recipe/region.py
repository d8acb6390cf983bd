"""Which AWS region a job uses when the recipe names none: the AWS CLI's order.

sagemaker.region in the recipe, else AWS_REGION, else AWS_DEFAULT_REGION, else the `region` of the
profile (AWS_PROFILE, else AWS_DEFAULT_PROFILE, else "default") in AWS_CONFIG_FILE or
~/.aws/config, else FALLBACK_REGION. Read with the standard library, so loading a recipe never
imports botocore.
"""

from __future__ import annotations

import configparser
import os
from pathlib import Path

FALLBACK_REGION = "us-west-2"


def profile_region() -> str | None:
    """The region of the current AWS profile in the shared config file, if it sets one."""
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    path = Path(os.environ.get("AWS_CONFIG_FILE") or Path.home() / ".aws" / "config").expanduser()
    config = configparser.ConfigParser(interpolation=None)
    try:
        config.read(path, encoding="utf-8")
    except (OSError, UnicodeDecodeError, configparser.Error):
        return None  # an unreadable config is the AWS SDK's to report when it is used
    section = "default" if profile == "default" else f"profile {profile}"
    return config.get(section, "region", fallback=None) or None


def default_region() -> str:
    """The region the AWS CLI would use here, or FALLBACK_REGION."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or profile_region() or FALLBACK_REGION
