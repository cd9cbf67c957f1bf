"""The Prefect layer: flows, tasks, deployments and the CLI. Importing it registers the store's
credentials resolver (Prefect Secret blocks), which the layers below never import."""

from flows.credentials import secret_block_credentials
from storage.store import register_credentials

register_credentials(secret_block_credentials)
