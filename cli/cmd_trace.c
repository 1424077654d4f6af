/* Placeholder until the 'trace' command lands; replaced by its module's owner. */
#include "cli.h"
int fm_cmd_trace(int argc, char **argv) {
    (void)argc; (void)argv;
    return fm_cli_fail("trace", fm_error(FM_E_UNSUPPORTED, "the 'trace' command is not built yet"));
}
