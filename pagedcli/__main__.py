from pagedcli.commands import main

main()
