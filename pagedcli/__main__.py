from pagedcli.cli import main

main()
