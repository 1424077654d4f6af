/* Placeholder until the 'explain' command lands; replaced by its module's owner. */
#include "cli.h"
int fm_cmd_explain(int argc, char **argv) {
    (void)argc; (void)argv;
    return fm_cli_fail("explain", fm_error(FM_E_UNSUPPORTED, "the 'explain' command is not built yet"));
}
