"""``swarmloco config show``: a swarm config as the peers run it, each field's meaning commented.

$ swarmloco config show                      # the built-in config
$ swarmloco config show --config swarm.toml  # a file's values over the defaults (what its peers run)
$ swarmloco config show > swarm.toml         # a starting point to edit: it loads back as the same config
"""

import typer

from peer.cli_common import ConfigOpt, app, config_or_default, user_errors
from swarm.config_toml import dumps_config

config_app = typer.Typer(help="Swarm configs: what each field means and holds.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
@user_errors
def config_show(config: ConfigOpt = None) -> None:
    """Print the effective config as TOML (the default, or the --config file over the defaults), each field's meaning commented."""
    typer.echo(dumps_config(config_or_default(config), commented=True), nl=False)
