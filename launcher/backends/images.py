"""The default training image: the region's PyTorch Deep Learning Container (dlc_images.yaml), and
which ECR registry an image lives in (docker logs in there before pulling).

The same file pins the wheels that image lacks (launcher/backends/wheelhouse.py reads them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from launcher.catalog.packaged_yaml import load_packaged
from launcher.errors import UsageError


@cache
def image_catalog() -> dict:
    return load_packaged(__package__, "dlc_images.yaml")


def default_image(region: str, device: str = "cuda") -> str:
    """The region's PyTorch training DLC for `device` (cuda or cpu)."""
    images = image_catalog()
    account = images["accounts"].get(region)
    if account is None:
        raise UsageError(f"cluster.image: no PyTorch training image is known for {region}; set cluster.image to one")
    suffix = images["dns_suffix"]["cn" if region.startswith("cn-") else "default"]
    return f"{account}.dkr.ecr.{region}.{suffix}/{images['repository']}:{images['tags'][device]}"


def training_image(recipe) -> str:
    """The recipe's own image (cluster.image), or the default for its region and device: a CPU job
    gets the CPU image, a fraction of the CUDA image's size and without its CUDA start-up checks."""
    return recipe.cluster.image or default_image(recipe.sagemaker.region, recipe.cluster.device)


# <account>.dkr.ecr[-fips].<region>.amazonaws.com[.cn]/<repository>[:tag|@digest]
_ECR_IMAGE = re.compile(r"^(?P<account>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/")


@dataclass(frozen=True, kw_only=True)
class EcrRegistry:
    """The private ECR registry an image lives in: what `docker login` needs."""

    host: str
    account: str
    region: str

    def login_command(self) -> str:
        """The AWS CLI line that logs Docker in, for users to run themselves."""
        return (
            f"aws ecr get-login-password --region {self.region} | "
            f"docker login --username AWS --password-stdin {self.host}"
        )


def ecr_registry(image: str) -> EcrRegistry | None:
    """The ECR registry of `image`, or None for an image elsewhere (Docker Hub, a local tag)."""
    match = _ECR_IMAGE.match(image)
    if match is None:
        return None
    return EcrRegistry(host=image.split("/", 1)[0], account=match["account"], region=match["region"])
