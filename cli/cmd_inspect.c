/* Placeholder until the 'inspect' command lands; replaced by its module's owner. */
#include "cli.h"
int fm_cmd_inspect(int argc, char **argv) {
    (void)argc; (void)argv;
    return fm_cli_fail("inspect", fm_error(FM_E_UNSUPPORTED, "the 'inspect' command is not built yet"));
}
