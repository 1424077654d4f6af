/* Placeholder until the 'tune' command lands; replaced by its module's owner. */
#include "cli.h"
int fm_cmd_tune(int argc, char **argv) {
    (void)argc; (void)argv;
    return fm_cli_fail("tune", fm_error(FM_E_UNSUPPORTED, "the 'tune' command is not built yet"));
}
