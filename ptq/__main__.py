from ptq.cli import main

main()
