/* Placeholder until the 'gen' command lands; replaced by its module's owner. */
#include "cli.h"
int fm_cmd_gen(int argc, char **argv) {
    (void)argc; (void)argv;
    return fm_cli_fail("gen", fm_error(FM_E_UNSUPPORTED, "the 'gen' command is not built yet"));
}
