from meshlm.cli import main

main()
