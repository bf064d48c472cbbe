"""The `run` section: the run's name, folder, seed and secret."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from relax.data.config import Section


class RunConfig(Section):
    name: str = Field("relax-run", description="Run name; the run folder is `<output_dir>/<name>`.")
    output_dir: str = Field("runs", description="Parent folder of run folders.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    token: SecretStr | None = Field(
        None,
        exclude=True,
        description="The run's secret, which every server the run starts requires as a bearer token; set by "
        "the Controller from RELAX_RUN_TOKEN or generated, kept in <run_dir>/secrets/run_token (0600), "
        "never written to config.yaml.",
    )

    def token_value(self) -> str | None:
        return self.token.get_secret_value() if self.token is not None else None

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name
