/* Placeholder until the 'forward' command lands; replaced by its module's owner. */
#include "cli.h"
int fm_cmd_forward(int argc, char **argv) {
    (void)argc; (void)argv;
    return fm_cli_fail("forward", fm_error(FM_E_UNSUPPORTED, "the 'forward' command is not built yet"));
}
