/* Placeholder until the 'profile' command lands; replaced by its module's owner. */
#include "cli.h"
int fm_cmd_profile(int argc, char **argv) {
    (void)argc; (void)argv;
    return fm_cli_fail("profile", fm_error(FM_E_UNSUPPORTED, "the 'profile' command is not built yet"));
}
