"""S3 credentials from a Prefect block, as an alternative to the standard AWS variables.

    from storage.s3_block import S3Credentials
    S3Credentials(endpoint_url="https://minio:9000", region="us-east-1",
                  aws_access_key_id="...", aws_secret_access_key="...").save("checkpoints")
    # run config: --set checkpoint.s3_block=checkpoints  (or the field in the Prefect UI form)

The flow loads the block at start and exports its values as the standard AWS variables of the flow's own
process, so ``storage.checkpoint_store`` (boto3's normal credential chain) picks them up. Only the block *name*
is part of the run config (and hence of MLflow params); the secrets stay in Prefect's block store.
"""

from __future__ import annotations

import os

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class S3Credentials(Block):
    _block_type_name = "ScalingInter S3 Credentials"
    _block_type_slug = "scalinginter-s3-credentials"
    _description = "Endpoint, region and credentials of the S3 store holding ScalingInter checkpoints."

    endpoint_url: str | None = Field(None, description="S3 endpoint (empty = AWS).")
    region: str | None = Field(None, description="Region, e.g. us-east-1.")
    aws_access_key_id: SecretStr | None = Field(None, description="Access key id.")
    aws_secret_access_key: SecretStr | None = Field(None, description="Secret access key.")
    aws_session_token: SecretStr | None = Field(None, description="Session token (temporary credentials).")

    def as_env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.endpoint_url:
            out["AWS_ENDPOINT_URL"] = self.endpoint_url
        if self.region:
            out["AWS_DEFAULT_REGION"] = self.region
        for field, var in (("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
                           ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
                           ("aws_session_token", "AWS_SESSION_TOKEN")):
            v = getattr(self, field)
            if v is not None and v.get_secret_value():
                out[var] = v.get_secret_value()
        return out


def apply_s3_block(name: str | None) -> list[str]:
    """Load the block ``name`` and export its values to this process's environment. Returns the variable
    names set (never their values)."""
    if not name:
        return []
    try:
        block = S3Credentials.load(name)
    except ValueError as e:
        raise ValueError(f"checkpoint.s3_block: no {S3Credentials._block_type_slug} block named {name!r} "
                         f"(create one with S3Credentials(...).save({name!r})): {e}") from None
    env = block.as_env()
    os.environ.update(env)
    return sorted(env)
