from pagedcli.commands.app import main

main()
